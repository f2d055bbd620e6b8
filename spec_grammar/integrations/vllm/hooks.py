"""The one rebinding both vLLM lines use: vLLM's backend name ``"guidance"`` builds our backend.

``StructuredOutputManager.grammar_init`` reads the module global ``GuidanceBackend`` of
``vllm.v1.structured_output`` when it builds the engine's backend, and the front end imports
``validate_guidance_grammar`` from ``backend_guidance`` inside its check (vLLM 0.32 and 0.34),
so rebinding those two module attributes is enough; no vLLM source is patched.
"""

from __future__ import annotations

__all__ = ["serve_guidance_name", "backend_part"]


def serve_guidance_name() -> str:
    """Rebind vLLM's ``"guidance"`` backend to ours. Returns what was rebound (for the start
    log line). Raises ``ImportError`` / ``AttributeError`` when this vLLM lacks the module
    attributes (an untested version: the caller reports the backend off)."""
    import vllm.v1.structured_output as manager
    import vllm.v1.structured_output.backend_guidance as guidance

    from .backend import SpecGrammarVllmBackend, validate_request

    for module, attr in ((manager, "GuidanceBackend"), (guidance, "validate_guidance_grammar")):
        if not hasattr(module, attr):
            raise AttributeError(f"{module.__name__}.{attr} is gone in this vLLM")
    manager.GuidanceBackend = SpecGrammarVllmBackend
    guidance.validate_guidance_grammar = validate_request
    return "vLLM's backend name 'guidance' runs ours"


def backend_part(backend_name: str | None, *, strict: bool) -> tuple[str, bool, str]:
    """The start line's ``("backend", on?, detail)`` part, the same on every vLLM line: off
    when ``SPEC_GRAMMAR_VLLM_BACKEND`` is unset, else :func:`serve_guidance_name` (its
    ``ImportError`` / ``AttributeError`` raised when ``strict``, else reported off)."""
    if backend_name is None:
        return ("backend", False, "SPEC_GRAMMAR_VLLM_BACKEND is unset")
    try:
        return ("backend", True, f"{backend_name}: {serve_guidance_name()}")
    except (ImportError, AttributeError) as e:
        if strict:
            raise
        return ("backend", False, str(e))
