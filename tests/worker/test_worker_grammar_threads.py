"""A step's grammar work split over threads (``SpecWorker(grammar_threads=N)``), on the real
SmolLM2 (float64) with the real xgrammar and llguidance backends.

Oracle: the same batch with ``grammar_threads=1`` (the one-thread grammar work). Splitting the
requests into groups must not change a single token or finish reason, with overlap on and off,
and a grammar fault must still end only its own request with the same error while the other
requests give exactly the tokens of a clean run.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from real_model import backend, model_and_tokenizer

from spec_grammar import JsonSchema, Regex
from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.worker import Request, SpecWorker, build_prompt
from spec_grammar.worker.engine import split_balanced
from spec_grammar.worker.sampling import SamplingParams

MAX_NEW = 12
SCHEMA_IDS = ["o27841", "o89088", "o12240"]
JSON_PROMPT = (
    "Reply with a minimal JSON document: use empty strings, 0 and empty lists where you can."
)


@given(hs.lists(hs.integers(1, 40), max_size=40), hs.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_split_balanced_is_contiguous_and_balanced(weights, parts):
    ranges = split_balanced(weights, parts)
    assert [i for r in ranges for i in r] == list(range(len(weights)))  # contiguous, in order
    assert all(len(r) > 0 for r in ranges) and len(ranges) == min(parts, len(weights))
    if weights:
        # boundaries at the running sum closest to each share: no range exceeds its fair
        # share by more than one request's weight
        share = sum(weights) / len(ranges)
        assert max(sum(weights[i] for i in r) for r in ranges) <= share + max(weights)


@pytest.mark.model
def test_default_grammar_threads():
    """One grammar thread unless asked for more; bad values are refused."""
    model, tok = model_and_tokenizer()
    assert SpecWorker(model, tok, backend=backend("xgrammar")).grammar_threads == 1
    assert (
        SpecWorker(model, tok, backend=backend("xgrammar"), grammar_threads=3).grammar_threads == 3
    )
    with pytest.raises(ValueError, match="grammar_threads must be None or an int >= 1, got 0"):
        SpecWorker(model, tok, backend=backend("xgrammar"), grammar_threads=0)


@functools.cache
def requests() -> list[Request]:
    """5 requests (an odd batch): JSON schemas (one sampled with a seed), a regex that finishes
    early (its matcher is fed its last tokens while the others still run) and a plain prompt."""
    _, tok = model_and_tokenizer()
    by_id = {r["id"]: r for r in jsonschemabench_sample()}
    greedy = SamplingParams(max_new_tokens=MAX_NEW)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3)
    reqs = [
        Request(
            build_prompt(tok, JSON_PROMPT),
            JsonSchema(by_id[i]["schema"]),
            sampled if n == 1 else greedy,
            rid=i,
        )
        for n, i in enumerate(SCHEMA_IDS)
    ]
    reqs.insert(
        1, Request(build_prompt(tok, "Yes or no?"), Regex(r"(yes|no|maybe)"), greedy, rid="regex")
    )
    reqs.append(Request(build_prompt(tok, "Name three colors."), None, greedy, rid="plain"))
    return reqs


def run(name: str, threads: int, overlap: bool = True) -> list:
    model, tok = model_and_tokenizer()
    with SpecWorker(
        model,
        tok,
        backend=backend(name),
        draft="ngram",
        num_draft_tokens=6,
        overlap=overlap,
        grammar_threads=threads,
    ) as w:
        assert w.grammar_threads == threads
        results = w.run(requests())
        steps = len(w.step_stats)
        # the host bitmask is reused: a few buffer allocations (growth), not one per step
        assert w._bitmasks.allocations <= 4 < steps, (w._bitmasks.allocations, steps)
    return results


@functools.cache
def reference(name: str) -> list:
    return run(name, 1)


@pytest.mark.model
def test_run_after_close_starts_the_threads_again():
    """``close()`` stops the grammar threads; a later ``run`` starts them again (it used to hit
    a closed pool) and gives the same output."""
    model, tok = model_and_tokenizer()
    w = SpecWorker(
        model,
        tok,
        backend=backend("xgrammar"),
        draft="ngram",
        num_draft_tokens=6,
        grammar_threads=3,
    )
    w.close()
    try:
        got = w.run(requests())
    finally:
        w.close()
    ref = reference("xgrammar")
    assert [(g.token_ids, g.finish_reason) for g in got] == [
        (r.token_ids, r.finish_reason) for r in ref
    ]


@pytest.mark.model
@pytest.mark.parametrize(
    "name,threads,overlap",
    [
        ("xgrammar", 2, True),
        ("xgrammar", 3, False),
        ("llguidance", 2, True),
        ("llguidance", 3, True),
    ],
)
def test_threads_give_the_one_thread_output(name, threads, overlap):
    ref = reference(name)
    got = run(name, threads, overlap)
    assert [(g.rid, g.token_ids, g.finish_reason) for g in got] == [
        (r.rid, r.token_ids, r.finish_reason) for r in ref
    ]
    assert all(g.error is None for g in got)
    assert ref[1].finish_detail == "grammar" and ref[1].num_tokens < MAX_NEW  # the early finisher
    # per-request grammar time is still measured for every grammar request
    assert all(g.grammar_ms_hidden + g.grammar_ms_exposed > 0 for g in got if g.rid != "plain")


@pytest.mark.model
@pytest.mark.parametrize("threads", [2, 3])
def test_fault_ends_only_its_request_with_threads(threads):
    """The fault-injecting xgrammar of the worker's reliability tests: a request whose fill
    raises (from its 2nd fill on) and one whose matcher raises on a committed token end alone
    with the one-thread errors; the good requests give exactly the tokens of a clean run."""
    from faults import ACCEPT_FAULT, FILL_FAULT, FaultyBackend, good_requests, request
    from faults import model_and_tokenizer as faulty_model
    from faults import reference as clean

    model, tok = faulty_model()
    reqs = good_requests()
    reqs.insert(1, request("the sea is", FILL_FAULT, "fill-fault", max_new_tokens=64))
    reqs.append(request("A cat", ACCEPT_FAULT, "accept-fault", max_new_tokens=64))
    b = FaultyBackend(tok, vocab_size=model.config.vocab_size)
    with SpecWorker(
        model, tok, backend=b, draft="ngram", num_draft_tokens=6, grammar_threads=threads
    ) as w:
        by = {r.rid: r for r in w.run(reqs)}
        assert not w.runner.request_ids  # every KV slot was freed
    r = by["fill-fault"]
    assert (r.finish_reason, r.steps) == ("error", 2)
    assert (
        r.error
        == "the grammar failed while filling the tree bitmask: RuntimeError: injected fault in fill_tree_bitmask"
    )
    r = by["accept-fault"]
    assert r.finish_reason == "error"
    assert (
        r.error
        == "the grammar failed while accepting committed tokens: RuntimeError: injected fault in accept_token"
    )
    ref = clean()
    assert {rid: (by[rid].token_ids, by[rid].finish_reason, by[rid].error) for rid in ref} == {
        rid: (toks, reason, None) for rid, (toks, reason) in ref.items()
    }
