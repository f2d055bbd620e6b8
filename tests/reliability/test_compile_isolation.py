"""Compiles in a compile process (``isolation="process"``, :mod:`spec_grammar.compile_worker`):
a compile past its limit is killed and the next one does not wait behind it; a compile that
aborts, runs out of its memory cap or meets a real schema that takes outlines-core past the cap
is a typed error and the process lives on; rows of grammars compiled there are those of the
in-thread compile (fresh-matcher oracle).

Each backend here starts compile processes (a fresh interpreter each, seconds on a loaded
host): one hostile backend serves the fault tests."""

from __future__ import annotations

import os
import random
import resource
import time

import pytest
from hostile_backends import (
    ABORT,
    ALLOCATE,
    HOSTILE_CAP_BYTES,
    NESTED_ARRAYS,
    SPIN,
    HostileOutlinesBackend,
)

from spec_grammar import JsonSchema, Regex, get_backend
from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from spec_grammar.compile_worker import ISOLATION_ENV, resolve_isolation
from spec_grammar.errors import GrammarCompileError, GrammarLimitError
from spec_grammar.registry import load_backend_class

pytestmark = pytest.mark.integration  # compile processes started, killed and replaced

ORDINARY = JsonSchema(
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
)


@pytest.fixture(scope="module")
def hostile(tok):
    b = HostileOutlinesBackend(
        tok, isolation="process", compile_memory_bytes=HOSTILE_CAP_BYTES, compile_timeout_s=60
    )
    # two idle: the compile after a killed one takes the second (a start takes seconds)
    assert b.compile_pool.warm(120, count=2)
    yield b
    b.compile_pool.close()


def _accepts(backend, spec, text: str, tok) -> bool:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    m = backend.matcher(backend.compile(spec))
    return m.accept_tokens(ids) == len(ids) and m.is_terminated()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_isolation_is_checked_and_defaults_by_backend(tok, monkeypatch):
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    assert resolve_isolation(load_backend_class("outlines"), None) == "process"
    assert resolve_isolation(load_backend_class("xgrammar"), None) == "thread"
    assert resolve_isolation(load_backend_class("llguidance"), None) == "thread"
    monkeypatch.setenv(ISOLATION_ENV, "thread")
    assert resolve_isolation(load_backend_class("outlines"), None) == "thread"
    assert resolve_isolation(load_backend_class("outlines"), "process") == "process"
    monkeypatch.setenv(ISOLATION_ENV, "fork")
    with pytest.raises(ValueError, match=f"{ISOLATION_ENV} must be one of process, thread"):
        get_backend("xgrammar", tok)
    monkeypatch.delenv(ISOLATION_ENV)
    with pytest.raises(ValueError, match="isolation must be one of process, thread, got 'proc'"):
        get_backend("xgrammar", tok, isolation="proc")
    with pytest.raises(ValueError, match="compile_memory_bytes must be None"):
        get_backend("xgrammar", tok, compile_memory_bytes=0)

    class Local(load_backend_class("outlines")):  # a child could not import it
        pass

    assert resolve_isolation(Local, None) == "thread"
    with pytest.raises(ValueError, match="defined in a function"):
        resolve_isolation(Local, "process")


def test_a_compile_past_its_limit_is_killed_and_the_next_is_prompt(hostile, tok):
    hostile.compile(Regex("[a-z]+ street"))
    pool = hostile.compile_pool
    assert pool.warm(120, count=2)
    with pool._cond:
        children = [c.process.pid for c in pool._idle]
    hostile.compile_timeout_s = 1.0
    try:
        t0 = time.perf_counter()
        with pytest.raises(
            GrammarCompileError,
            match=r"^\[outlines\] regex compile did not finish within compile_timeout_s=1.0: "
            "its compile process was killed$",
        ):
            hostile.compile(SPIN)
        assert time.perf_counter() - t0 < 4.0  # the limit holds
        t0 = time.perf_counter()
        compiled = hostile.compile(ORDINARY)
        waited = time.perf_counter() - t0
    finally:
        hostile.compile_timeout_s = 60
    # its own time (the warm spare's work and the transfer), not the spinning compile's
    assert compiled.compile_wait_s < 0.5, compiled.compile_wait_s
    assert waited < compiled.compile_time_s - compiled.compile_wait_s + 1.0, waited
    assert _accepts(hostile, ORDINARY, '{"city": "Lyon", "population": 522250}', tok)
    assert sum(not _alive(p) for p in children) == 1  # the spinning one: killed and reaped


def test_an_abort_in_the_compile_is_a_typed_error_and_the_process_lives(hostile, tok):
    with pytest.raises(
        GrammarLimitError, match=r"aborted \(signal SIGABRT\).*compile_memory_bytes"
    ):
        hostile.compile(ABORT)
    assert _accepts(hostile, Regex("[0-9]{3}"), "123", tok)


def test_an_allocation_over_the_cap_is_a_limit_error(hostile, tok):
    with pytest.raises(
        GrammarLimitError, match=r"ran out of memory \(MemoryError.*raise compile_memory_bytes"
    ):
        hostile.compile(ALLOCATE)
    assert _accepts(hostile, Regex("[a-z]{2}"), "ok", tok)


def test_nested_arrays_take_outlines_past_the_cap_not_the_process(hostile, tok):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(GrammarLimitError, match=r"compile_memory_bytes=1.25 GiB"):
        hostile.compile(NESTED_ARRAYS)
    # the index was built (and failed) in the child: this process's peak did not move by its GB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024
    assert _accepts(hostile, ORDINARY, '{"city": "Oslo", "population": 709037}', tok)


SCHEMAS = [
    ORDINARY,
    JsonSchema(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                "score": {"type": "number"},
            },
            "required": ["name", "tags"],
        }
    ),
    Regex(r"(north|south)-[0-9]{2,4}"),
]


@pytest.mark.parametrize("name", ["outlines", "xgrammar", "llguidance"])
def test_rows_of_the_process_path_are_those_of_the_thread_path(name, tok):
    """Oracle: the in-thread compile of the same backend; the same random walk through both
    grammars' rows (a fresh matcher each) must see equal rows and warnings at every state."""
    in_process = get_backend(name, tok, isolation="process")
    in_thread = get_backend(name, tok, isolation="thread")
    try:
        rng = random.Random(0)
        for spec in SCHEMAS:
            a, b = in_process.compile(spec), in_thread.compile(spec)
            assert a.warnings == b.warnings
            assert in_process.compile(spec) is a  # a cache hit: no compile process involved
            ma, mb = in_process.matcher(a), in_thread.matcher(b)
            rows = allocate_token_bitmask(2, in_thread.vocab_size)
            for _ in range(24):
                if mb.is_terminated():
                    break
                ma.fill_next_token_bitmask(rows, 0)
                mb.fill_next_token_bitmask(rows, 1)
                assert rows[0].equal(rows[1])
                t = rng.choice(allowed_token_ids(rows[1]))
                assert ma.accept_token(t) and mb.accept_token(t)
        assert in_process.num_compiles == len(SCHEMAS)
    finally:
        in_process.compile_pool.close()
