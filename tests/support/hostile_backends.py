"""Hostile compiles for the compile-isolation tests and the hostile soak: a real outlines
backend whose ``_compile`` spins, aborts or allocates for the marker specs below (in a compile
process they run there and are killed there), and a real schema that takes outlines-core past
a memory cap its index-size estimate lets through."""

from __future__ import annotations

import os
import time

import pytest

from spec_grammar import JsonSchema, Regex

# the test modules that import this one are skipped, not broken, without outlines-core
OutlinesBackend = pytest.importorskip("spec_grammar_outlines", exc_type=ImportError).OutlinesBackend

SPIN = Regex("spin-for-ever")
"""Its compile spins in Python, holding the interpreter, and never returns."""
ABORT = Regex("abort-the-process")
"""Its compile calls ``os.abort()`` (SIGABRT), as a failed native allocation does."""
ALLOCATE = Regex("allocate-too-much")
"""Its compile allocates :data:`ALLOCATE_BYTES` at once."""
ALLOCATE_BYTES = 16 << 30  # past the default compile_memory_bytes (8 GiB) too

NESTED_ARRAYS = JsonSchema(
    {
        "type": "array",
        "maxItems": 4,
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "array",
                "maxItems": 4,
                "items": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "maxItems": 4, "items": {"type": "string"}},
                    ]
                },
            },
        },
    },
    whitespace="compact",
)
"""Arrays of <= 4 nested four deep, strings at the leaves: outlines-core's estimated index is
189 MB (under ``max_index_bytes``), its build took ~1 GB over the process's baseline and 27 s
(SmolLM2, 2 loaded cores); under a 1.25 GiB address-space cap it aborts (``memory allocation
of 536870912 bytes failed``, SIGABRT) after ~13 s."""

HOSTILE_CAP_BYTES = int(1.25 * 2**30)
"""A compile process cap that fits ordinary compiles (a child's baseline is ~0.75 GiB) and not
:data:`NESTED_ARRAYS`."""


class HostileOutlinesBackend(OutlinesBackend):
    """The real outlines backend, but ``_compile`` of :data:`SPIN` / :data:`ABORT` /
    :data:`ALLOCATE` spins, aborts or allocates (everything else compiles as outlines does).

    ``walls``: per :meth:`compile` call in this process, ``(spec, wall seconds, its
    CompiledGrammar or None when it raised)``: what an ordinary request's compile waited
    beyond its own time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.walls: list[tuple] = []

    def compile(self, spec):
        t0 = time.perf_counter()
        try:
            compiled = super().compile(spec)
        except Exception:
            self.walls.append((spec, time.perf_counter() - t0, None))
            raise
        self.walls.append((spec, time.perf_counter() - t0, compiled))
        return compiled

    def _compile(self, spec):
        if spec == SPIN:
            while True:
                pass
        if spec == ABORT:
            os.abort()
        if spec == ALLOCATE:
            held = bytearray(ALLOCATE_BYTES)
            del held
        return super()._compile(spec)
