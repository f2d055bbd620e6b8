"""The real SmolLM2 model and JSON-schema backends shared by the model-running test files.

One cached float64 copy per test session: float64 keeps speculative vs non-speculative greedy
comparisons free of near-tie argmax flips caused by different matmul shapes.
"""

from __future__ import annotations

import functools

import torch

from spec_grammar import get_backend, list_backends

# JSON-schema backends: regex-only adapters (the interegular example) have their own tests.
JSON_BACKENDS = [
    b.name
    for b in list_backends()
    if b.error is None and b.capabilities.json_schema and b.capabilities.tool_calls
]


@functools.cache
def model_and_tokenizer():
    from spec_grammar.models import load_model, load_tokenizer

    return load_model("smollm2", dtype=torch.float64), load_tokenizer("smollm2")


@functools.cache
def backend(name: str):
    model, tok = model_and_tokenizer()
    return get_backend(name, tok, vocab_size=model.config.vocab_size)
