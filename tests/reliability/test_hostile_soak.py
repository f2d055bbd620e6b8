"""Hostile soak: hostile grammars (a compile that spins past its limit, one that aborts, one
that allocates past its cap, a real schema that takes outlines-core past the cap) interleaved
with ordinary requests in one process, through the speculative worker on the real SmolLM2 and
through the SGLang and vLLM backend objects (skipped when their packages are absent). Every
ordinary request completes with a document its schema accepts (jsonschema, the oracle), every
hostile one ends with its typed error, and no ordinary compile waits beyond its own time plus
the documented bound (one compile-process start, :data:`CHILD_START_BOUND_S`).

The short worker soak runs one round; ``--run-slow`` runs three and the nested-arrays schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hostile_backends import (
    ABORT,
    ALLOCATE,
    HOSTILE_CAP_BYTES,
    NESTED_ARRAYS,
    SPIN,
    HostileOutlinesBackend,
)

from spec_grammar import JsonSchema
from spec_grammar.compile_worker import CHILD_START_BOUND_S, ISOLATION_ENV
from spec_grammar.errors import GrammarCompileError, GrammarLimitError

_HOSTILE = [
    (SPIN, "did not finish within compile_timeout_s="),
    (ABORT, "aborted (signal SIGABRT)"),
    (ALLOCATE, "ran out of memory (MemoryError"),
    (NESTED_ARRAYS, "compile_memory_bytes=1.25 GiB"),
]


def hostile_error(spec) -> str | None:
    """What the error of hostile ``spec`` says (None: an ordinary spec)."""
    return next((why for h, why in _HOSTILE if h == spec), None)


def ordinary(k: int) -> JsonSchema:
    """A small closed object, distinct per ``k`` (each request a real compile, no cache hit)."""
    return JsonSchema(
        {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no", f"maybe-{k}"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
        whitespace="compact",
    )


def _hostile_backend(tok, width=None, timeout_s: float = 2.0) -> HostileOutlinesBackend:
    b = HostileOutlinesBackend(
        tok,
        vocab_size=width,
        isolation="process",
        compile_memory_bytes=HOSTILE_CAP_BYTES,
        compile_timeout_s=timeout_s,
    )
    assert b.compile_pool.warm(120, count=2)
    return b


def _check_walls(backend) -> None:
    """Each ordinary compile (one that returned) took its own time (the compile process's
    work and the transfer) plus at most the documented bound: a wait for a process start."""
    for spec, wall, compiled in backend.walls:
        if compiled is not None:
            own = compiled.compile_time_s - compiled.compile_wait_s
            assert compiled.compile_wait_s <= CHILD_START_BOUND_S, (spec, compiled.compile_wait_s)
            assert wall <= own + CHILD_START_BOUND_S, (spec, wall, own)


def _mix(rounds: int, nested: bool) -> list:
    hostile = [SPIN, ABORT, ALLOCATE] + ([NESTED_ARRAYS] if nested else [])
    out: list = []
    k = 0
    for _ in range(rounds):
        for h in hostile:
            out += [ordinary(k), h]
            k += 1
    return out + [ordinary(k)]


@pytest.mark.model
@pytest.mark.parametrize(
    "rounds,nested",
    [(1, False), pytest.param(3, True, marks=pytest.mark.slow)],
    ids=["short", "long"],
)
def test_hostile_soak_through_the_worker(rounds, nested):
    from real_model import model_and_tokenizer

    from spec_grammar.worker import Request, SpecWorker
    from spec_grammar.worker.sampling import SamplingParams

    model, tok = model_and_tokenizer()
    # the nested-arrays build reaches the cap after ~13 s: under a limit that lets it
    backend = _hostile_backend(tok, model.config.vocab_size, 40.0 if nested else 2.0)
    specs = _mix(rounds, nested)
    reqs = [
        Request(
            tok.encode("Answer yes or no as JSON:"),
            spec,
            SamplingParams(max_new_tokens=24),
            rid=f"r{i}",
        )
        for i, spec in enumerate(specs)
    ]
    try:
        with SpecWorker(model, tok, backend=backend, draft="ngram", num_draft_tokens=4) as w:
            results = w.run(reqs)
    finally:
        backend.compile_pool.close()
    for spec, r in zip(specs, results):
        why = hostile_error(spec)
        if why is not None:
            assert r.finish_reason == "error" and why in r.error, r.error
        else:
            assert r.finish_reason == "stop", (r.finish_reason, r.error, r.text)
            jsonschema.validate(json.loads(r.text), spec.json_schema)
    _check_walls(backend)


def test_hostile_soak_through_the_sglang_backend_object(tok):
    pytest.importorskip("sglang")
    from spec_grammar.integrations.sglang.grammar import SGLangGrammar, SGLangGrammarBackend

    backend = _hostile_backend(tok)
    sgl = SGLangGrammarBackend(backend, whitespace="compact")
    try:
        for spec in _mix(1, False):
            if hostile_error(spec) is not None:
                g = sgl.dispatch_regex(spec.pattern)
                assert not isinstance(g, SGLangGrammar)
                continue
            g = sgl.dispatch_json(json.dumps(spec.json_schema))
            assert isinstance(g, SGLangGrammar), g
            _accepts_document(backend, g.compiled, {"answer": "no"}, tok)
    finally:
        backend.compile_pool.close()
    _check_walls(backend)


def test_hostile_soak_through_the_vllm_backend_object(tok, monkeypatch):
    pytest.importorskip("vllm")
    from vllm.config import StructuredOutputsConfig, VllmConfig
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions as Opt

    from spec_grammar.integrations import vllm as plugin
    from spec_grammar.integrations.vllm.backend import SpecGrammarVllmBackend

    # the plugin builds its backend by name: the hostile class (module:Class), in processes
    monkeypatch.setenv(plugin.BACKEND_ENV, "hostile_backends:HostileOutlinesBackend")
    monkeypatch.setenv(plugin.WHITESPACE_ENV, "compact")
    monkeypatch.setenv(ISOLATION_ENV, "process")
    config = VllmConfig(structured_outputs_config=StructuredOutputsConfig(backend="guidance"))
    be = SpecGrammarVllmBackend(config, tokenizer=tok, vocab_size=len(tok))
    try:
        # SPIN is left out: the plugin's backend has the default 60 s limit
        for spec in [ordinary(0), ABORT, ordinary(1), ALLOCATE, ordinary(2)]:
            if hostile_error(spec) is not None:
                with pytest.raises((GrammarLimitError, GrammarCompileError)):
                    be.compile_grammar(Opt.REGEX, spec.pattern)
                continue
            g = be.compile_grammar(Opt.JSON, json.dumps(spec.json_schema))
            _accepts_document(g.backend, g.compiled, {"answer": "yes"}, tok)
        _check_walls(g.backend)
    finally:
        be.destroy()


def _accepts_document(backend, compiled, doc, tok) -> None:
    """A fresh matcher accepts ``doc`` (which jsonschema accepts) and ends there."""
    jsonschema.validate(doc, compiled.spec.json_schema)
    ids = tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
    m = backend.matcher(compiled)
    assert m.accept_tokens(ids + [tok.eos_token_id]) == len(ids) + 1 and m.is_terminated()
