"""Random-weight models of real shapes, for tests and timing runs (timings do not depend on the
weights' values): :data:`MODEL_SHAPES` and :func:`build_model`.

Used by the worker's tests (the ``tiny`` shape on CPU; the real shapes in the GPU tests) and by
the GPU benchmark (``spec-grammar bench gpu``, ``benchmarks/spec_grammar_bench/gpu.py``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MODEL_SHAPES", "build_model"]

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # HuggingFaceTB/SmolLM2-135M config.json
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # CPU tests and smoke runs only
    "tiny": dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}
"""Shape name -> ``LlamaConfig`` fields."""


def build_model(
    shape: str, device: str | torch.device, dtype: torch.dtype, **overrides: Any
) -> Any:
    """A random-weight ``LlamaForCausalLM`` of :data:`MODEL_SHAPES[shape]` (config fields
    replaced by ``overrides``), created directly on ``device`` in ``dtype`` (eval mode, sdpa
    attention). ``KeyError`` for an unknown shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**MODEL_SHAPES[shape], **overrides})
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
