"""vLLM 0.34's config of our drafter (``speculative_config.method="spec_grammar"``), registered
by :mod:`.v0_34` through ``register_speculative_method``. It behaves as vLLM's n-gram
speculator (``base_method="ngram"``: ``prompt_lookup_min/max`` as for ``method="ngram"``, no
draft model) and names :class:`~.speculator.GrammarNgramSpeculator` as its implementation. Light
on purpose: vLLM imports speculator configs in every process (its rule: no speculator imports
here)."""

from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.ngram.config import NgramSpeculatorConfig

__all__ = ["GrammarNgramSpeculatorConfig"]


class GrammarNgramSpeculatorConfig(NgramSpeculatorConfig):
    """vLLM's n-gram speculator config with our speculator class."""

    speculator_class = "spec_grammar.integrations.vllm.speculator.GrammarNgramSpeculator"
