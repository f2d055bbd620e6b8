"""The one rebinding both vLLM lines use: vLLM's backend name ``"guidance"`` builds our backend.

``StructuredOutputManager.grammar_init`` reads the module global ``GuidanceBackend`` of
``vllm.v1.structured_output`` when it builds the engine's backend, and the front end imports
``validate_guidance_grammar`` from ``backend_guidance`` inside its check (vLLM 0.32 and 0.34),
so rebinding those two module attributes is enough; no vLLM source is patched.
"""

from __future__ import annotations

__all__ = ["serve_guidance_name"]


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
