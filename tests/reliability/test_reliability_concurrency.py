"""Concurrent compiles on every backend: 8 threads compiling the same and different specs at
once (valid and invalid) run one compile per spec, all threads get the identical result (or
the identical typed error), and matchers from it behave as a single-threaded compile's do.
Also: the compile cache is bounded (LRU eviction) on every backend."""

from __future__ import annotations

import threading
from functools import cache

import pytest
import torch

from spec_grammar import get_backend
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import GrammarCompileError
from spec_grammar.specs import JsonSchema, Regex
from spec_grammar.testing.fixtures import fixture_tokenizer as _fixture_tokenizer

BACKENDS = ("xgrammar", "llguidance", "outlines")
THREADS = 8


@cache
def smollm2():
    return _fixture_tokenizer("smollm2")


def fresh_backend(name: str, **options):
    tok, width = smollm2()
    return get_backend(name, tok, vocab_size=width, **options)


def specs():
    schemas = [
        JsonSchema(
            {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer"}},
                "required": [f"k{i}"],
                "additionalProperties": False,
            }
        )
        for i in range(3)
    ]
    return schemas + [Regex(r"[a-c]{2,4}"), Regex("(unclosed")]


@pytest.mark.parametrize("name", BACKENDS)
def test_concurrent_compiles_run_once_per_spec(name):
    b = fresh_backend(name)
    todo = specs()
    barrier = threading.Barrier(THREADS)
    results: dict[int, list] = {}

    def work(i: int) -> None:
        barrier.wait()
        out = []
        order = todo[i % len(todo) :] + todo[: i % len(todo)]  # threads start on different specs
        for s in order + order:  # each spec twice per thread: cache hits race with compiles
            try:
                out.append((s, b.compile(s)))
            except GrammarCompileError as e:
                out.append((s, e))
        results[i] = out

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == THREADS
    assert b.num_compiles == len(todo)
    first: dict[str, object] = {}
    for out in results.values():
        for s, r in out:
            first.setdefault(s.cache_key(), r)
            assert r is first[s.cache_key()], f"{s}: threads got different results"
    err = first[Regex("(unclosed").cache_key()]
    assert isinstance(err, GrammarCompileError) and str(err).startswith(
        f"[{name}] regex failed to compile"
    )

    # matchers from the concurrently compiled grammars match a single-threaded compile's
    ref = fresh_backend(name)
    tok = smollm2()[0]
    for s in todo[:4]:
        m1, m2 = b.matcher(first[s.cache_key()]), ref.matcher(ref.compile(s))
        text = '{"k0": 1' if isinstance(s, JsonSchema) else "ab"
        for t in tok.encode(text, add_special_tokens=False):
            assert m1.accept_token(t) == m2.accept_token(t)
        bm = allocate_token_bitmask(2, b.vocab_size)
        m1.fill_next_token_bitmask(bm, 0)
        m2.fill_next_token_bitmask(bm, 1)
        assert torch.equal(bm[0], bm[1])


@pytest.mark.parametrize("name", BACKENDS)
def test_compile_cache_is_bounded(name):
    b = fresh_backend(name, compile_cache_size=3)
    for i in range(6):
        b.compile(Regex(f"x{{{i + 1}}}"))
    assert len(b._cache) == 3 and b.num_compiles == 6
    b.compile(Regex("x{6}"))  # most recent: a hit
    assert b.num_compiles == 6
    b.compile(Regex("x{1}"))  # evicted: compiled again
    assert b.num_compiles == 7 and len(b._cache) == 3
