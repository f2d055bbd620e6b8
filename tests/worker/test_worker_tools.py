"""Tool calls through the real worker and SmolLM2 (float64) on shared BFCL cases:
``tool_choice="auto"`` (tagged calls in free text), a named function and single-call
``"required"``. Every emitted call parses and validates against its tool's parameters
(jsonschema); greedy speculative output equals plain decoding with every drafter kind; sampled
outputs replay on a fresh matcher."""

from __future__ import annotations

import functools

import jsonschema
import pytest
from real_model import JSON_BACKENDS, backend, model_and_tokenizer, replays

from spec_grammar import ToolCalls
from spec_grammar.datasets import bfcl_cases
from spec_grammar.specs import openai_strict
from spec_grammar.tool_calls import parse_tool_calls
from spec_grammar.worker import Request, SpecWorker, build_prompt, schema_prompt
from spec_grammar.worker.sampling import SamplingParams

pytestmark = pytest.mark.model

MAX_NEW = 64
CONFIGS = {
    # forced tokens and constrained drafting with the n-gram drafter, a model drafter without
    "ngram-tree-overlap": dict(
        draft="ngram", num_draft_tokens=6, overlap=True, forced_tokens=True, constrain_draft=True
    ),
    "ngram-lazy": dict(draft="ngram", num_draft_tokens=6, lazy_grammar=True),
    "self-tree-sync": dict(draft="self:2", topk=2, num_steps=3, num_draft_tokens=6, overlap=False),
}


def cases() -> list[dict]:
    return [c for c in bfcl_cases() if len(c["messages"]) == 1][:1]


@functools.cache
def requests(sampled: bool = False) -> list[Request]:
    _, tok = model_and_tokenizer()
    params = SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0.8 if sampled else 0.0, seed=7 if sampled else None
    )
    out = []
    for case in cases():
        user = case["messages"][0][-1]["content"]
        first = case["tools"][0]["function"]["name"]
        for choice, extra in (
            ("auto", {}),
            (first, {"format": "tagged"}),
            ("required", {"parallel_tool_calls": False}),
        ):
            spec = ToolCalls(case["tools"], tool_choice=choice, **extra)
            out.append(
                Request(
                    build_prompt(tok, schema_prompt(spec, user)),
                    spec,
                    params,
                    rid=f"{case['id']}-{choice}",
                )
            )
    return out


def run(name: str, sampled: bool = False, **options) -> list:
    model, tok = model_and_tokenizer()
    with SpecWorker(model, tok, backend=backend(name), **options) as worker:
        return worker.run(requests(sampled))


@functools.cache
def reference(name: str) -> list:
    return run(name, no_spec=True)


def check_calls(req: Request, res) -> int:
    """Asserts the output replays and that every closed call names a selected tool with valid
    arguments; returns the number of calls."""
    spec = req.grammar
    assert res.finish_detail in ("grammar", "length"), res
    assert replays(res_backend[0], spec, res.token_ids, res.finish_detail == "grammar"), res
    text = res.text
    if res.finish_detail != "grammar":  # cut: only the calls closed so far are complete
        text = (
            text[: text.rfind(spec.call_close) + len(spec.call_close)]
            if spec.call_format == "tagged"
            else "[]"
        )
    _, calls = parse_tool_calls(text, spec)
    fns = {f["name"]: f for f in spec.functions()}
    for call in calls:
        fn = fns[call["name"]]
        params = fn.get("parameters", {})
        jsonschema.validate(
            call["arguments"], openai_strict(params) if fn.get("strict") else params
        )
    if spec.max_calls is not None:
        assert len(calls) <= spec.max_calls
    return len(calls)


res_backend = [""]


# xgrammar in the default run; the others (their matchers are checked in
# tests/core/test_tool_calls.py) under --run-slow
SLOW = [pytest.mark.slow]


@pytest.mark.parametrize(
    "name", [pytest.param(b, marks=[] if b == "xgrammar" else SLOW) for b in JSON_BACKENDS]
)
def test_every_emitted_call_parses_and_validates(name):
    res_backend[0] = name
    n_calls = sum(check_calls(q, r) for q, r in zip(requests(), reference(name)))
    assert n_calls >= 2, "too few calls to check"


@pytest.mark.parametrize(
    "name,config",
    [
        pytest.param(b, c, marks=[] if b == "xgrammar" and c != "ngram-lazy" else SLOW)
        for b in JSON_BACKENDS
        for c in (CONFIGS if b == "xgrammar" else ("ngram-tree-overlap",))
    ],
)
def test_speculative_equals_plain_decoding_with_tools(name, config):
    got = run(name, **CONFIGS[config])
    for r, g in zip(reference(name), got):
        assert (g.token_ids, g.finish_detail) == (r.token_ids, r.finish_detail), (
            r.rid,
            r.text,
            g.text,
        )


def test_sampled_tool_calls_are_valid():
    res_backend[0] = "xgrammar"
    results = run("xgrammar", sampled=True, draft="ngram", num_draft_tokens=6)
    for q, r in zip(requests(True), results):
        check_calls(q, r)
