"""Requests that reason first (``reasoning_end``) through the real worker and SmolLM2 (float64):
greedy speculative output equals plain decoding under the same rules with every drafter kind,
overlap on and off; the part after the marker replays on a fresh matcher that never saw the
reasoning and validates with jsonschema; the reasoning holds no stop token and respects the
budget."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
from real_model import JSON_BACKENDS, backend, model_and_tokenizer, replays

from spec_grammar import JsonSchema, Regex
from spec_grammar.reasoning import reasoning_token_count, resolve_marker
from spec_grammar.worker import Request, SpecWorker, build_prompt
from spec_grammar.worker.sampling import SamplingParams

pytestmark = pytest.mark.model

MARKER = "</think>"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}
PROMPT = f"Think step by step, write {MARKER}, then answer in JSON: which city is Paris in?"
CONFIGS = {
    # forced tokens and constrained drafting with the n-gram drafter, a model drafter without
    "ngram-tree-overlap": dict(
        draft="ngram", num_draft_tokens=6, overlap=True, forced_tokens=True, constrain_draft=True
    ),
    "ngram-tree-sync": dict(draft="ngram", num_draft_tokens=6, overlap=False),
    "ngram-lazy": dict(draft="ngram", num_draft_tokens=6, lazy_grammar=True),
    "self-tree": dict(draft="self:2", topk=2, num_steps=3, num_draft_tokens=6),
}


@functools.cache
def requests(name: str) -> list[Request]:
    _, tok = model_and_tokenizer()
    params = SamplingParams(max_new_tokens=24)
    prompt = build_prompt(tok, PROMPT)
    spec = JsonSchema(SCHEMA)
    out = [
        Request(
            prompt, spec, params, rid=f"budget-{b}", reasoning_end=MARKER, max_reasoning_tokens=b
        )
        for b in (0, 6)
    ]
    marker_ids = resolve_marker(backend(name).tokenizer_info, MARKER)[1]
    out.append(
        Request(prompt, spec, params, rid="ids", reasoning_end=marker_ids, max_reasoning_tokens=5)
    )
    out.append(
        Request(
            prompt,
            Regex(r"(yes|no)"),
            params,
            rid="regex",
            reasoning_end=MARKER,
            max_reasoning_tokens=4,
        )
    )
    out.append(Request(prompt, spec, params, rid="no-reasoning"))
    return out


def run(name: str, **options) -> list:
    model, tok = model_and_tokenizer()
    with SpecWorker(model, tok, backend=backend(name), **options) as worker:
        return worker.run(requests(name))


@functools.cache
def reference(name: str) -> list:
    return run(name, no_spec=True)


# xgrammar in the default run; the others (their matchers are checked in
# tests/core/test_reasoning.py) under --run-slow
SLOW = [pytest.mark.slow]


@pytest.mark.parametrize(
    "name", [pytest.param(b, marks=[] if b == "xgrammar" else SLOW) for b in JSON_BACKENDS]
)
def test_reasoning_outputs_follow_the_grammar_after_the_marker(name):
    info = backend(name).tokenizer_info
    marker = MARKER.encode()
    for req, res in zip(requests(name), reference(name)):
        assert res.finish_detail in ("grammar", "length"), res
        ids = res.token_ids
        if req.reasoning_end is None:
            assert res.reasoning_text is None
            k = 0
        else:
            k = reasoning_token_count(info, ids, marker)
            assert k is not None and k <= req.max_reasoning_tokens + len(
                resolve_marker(info, MARKER)[1]
            ), res
            assert not set(ids[:k]) & set(info.stop_token_ids)
            assert res.reasoning_text + MARKER == info.decode(ids[:k])
        assert replays(name, req.grammar, ids[k:], res.finish_detail == "grammar"), res
        if res.finish_detail == "grammar" and req.rid != "regex":
            jsonschema.validate(json.loads(res.text), SCHEMA)
    assert sum(r.finish_detail == "grammar" for r in reference(name)) >= 3


@pytest.mark.parametrize(
    "name,config",
    [
        pytest.param(b, c, marks=[] if b == "xgrammar" and c != "ngram-tree-sync" else SLOW)
        for b in JSON_BACKENDS
        for c in (CONFIGS if b == "xgrammar" else ("ngram-tree-overlap",))
    ],
)
def test_speculative_equals_plain_decoding_with_reasoning(name, config):
    got = run(name, **CONFIGS[config])
    for r, g in zip(reference(name), got):
        assert (g.token_ids, g.finish_detail, g.reasoning_text) == (
            r.token_ids,
            r.finish_detail,
            r.reasoning_text,
        ), (r.rid, r.text, g.text)


def test_bad_reasoning_fields_fail_only_their_request():
    model, tok = model_and_tokenizer()
    params = SamplingParams(max_new_tokens=4)
    prompt = build_prompt(tok, "Hi")
    spec = JsonSchema(SCHEMA)
    reqs = [
        Request(prompt, spec, params, rid="empty", reasoning_end=""),
        Request(prompt, spec, params, rid="budget-alone", max_reasoning_tokens=3),
        Request(prompt, spec, params, rid="neg", reasoning_end=MARKER, max_reasoning_tokens=-1),
        Request(prompt, spec, params, rid="bad-id", reasoning_end=[10**9]),
        Request(prompt, spec, params, rid="good", reasoning_end=MARKER, max_reasoning_tokens=0),
    ]
    with SpecWorker(model, tok, backend=backend("xgrammar")) as worker:
        results = {r.rid: r for r in worker.run(reqs)}
    for rid in ("empty", "budget-alone", "neg", "bad-id"):
        assert results[rid].finish_reason == "error" and results[rid].error, results[rid]
    assert results["good"].finish_reason != "error"
    assert results["good"].reasoning_text == ""
