"""vLLM 0.34: our backend under vLLM's name ``"guidance"``, and our drafter registered through
vLLM's speculator registry (``register_speculative_method``, experimental in 0.34) as
``speculative_config.method="spec_grammar"`` (:mod:`.speculator_config`, :mod:`.speculator`).
0.34 rejects ``method="custom_class"`` and deleted the 0.32 proposer the old drafter built on."""

from __future__ import annotations

from . import DRAFTER_METHOD
from .hooks import backend_part

__all__ = ["CONFIG_QUALNAME", "register"]

CONFIG_QUALNAME = "spec_grammar.integrations.vllm.speculator_config.GrammarNgramSpeculatorConfig"
"""Registered by name: vLLM imports it when a config names the method (every process)."""


def register(backend_name: str | None, *, strict: bool = True) -> list[tuple[str, bool, str]]:
    """Set up the 0.34 line; returns ``(part, on?, detail)`` per part. ``strict``: raise
    instead of reporting a part off (a tested version)."""
    report = [backend_part(backend_name, strict=strict)]
    try:
        from vllm.v1.worker.gpu.spec_decode.speculator_config import (
            register_speculative_method,
        )

        register_speculative_method(DRAFTER_METHOD, CONFIG_QUALNAME)
        report.append(("drafter", True, f"speculative_config.method={DRAFTER_METHOD!r}"))
    except (ImportError, TypeError, ValueError) as e:
        if strict:
            raise
        report.append(("drafter", False, f"vLLM's speculator registry refused it: {e}"))
    return report
