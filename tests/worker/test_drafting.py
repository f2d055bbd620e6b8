"""Grammar-aware drafting (constrained trees, forced tokens, row reuse) on the real SmolLM2
(float64: near-tie argmax flips between batch shapes cannot happen) with real grammars.

Oracles: a fresh ``fill_tree_bitmask`` of every drafted tree (row reuse), plain constrained
decoding through the same worker (outputs must not change with the drafter), fresh-matcher
replay of outputs, ``re.fullmatch``.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from real_model import JSON_BACKENDS, backend, draft_steps, model_and_tokenizer, replays

from spec_grammar import JsonSchema, Regex, ToolCalls
from spec_grammar.bitmask import allocate_token_bitmask, unpack_bitmask
from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.worker import Request, SpecWorker, build_prompt, schema_prompt
from spec_grammar.worker.drafters import ModelDrafter, NgramDrafter, truncated_model
from spec_grammar.worker.drafters.constrained import (
    GrammarAwareDrafter,
    current_matcher,
    make_grammar_drafter,
)
from spec_grammar.worker.drafters.vocab_map import (
    DraftVocabError,
    check_draft_vocab,
    draft_vocab_bitmask,
)
from spec_grammar.worker.request import RequestState
from spec_grammar.worker.runner import ModelRunner
from spec_grammar.worker.sampling import SamplingParams

pytestmark = pytest.mark.model

MAX_NEW = 16
BACKENDS = JSON_BACKENDS


@functools.cache
def requests() -> list[Request]:
    """Two BFCL tool cases (ToolCalls) and two JSONSchemaBench schemas, schema in the prompt."""
    _, tok = model_and_tokenizer()
    params = SamplingParams(max_new_tokens=MAX_NEW)
    reqs = []
    for case in bfcl_cases()[:2]:
        spec = ToolCalls(case["tools"])
        question = " ".join(m["content"] for m in case["messages"][0] if m.get("role") == "user")
        reqs.append(
            Request(build_prompt(tok, schema_prompt(spec, question)), spec, params, rid=case["id"])
        )
    by_id = {r["id"]: r for r in jsonschemabench_sample()}
    for sid in ("o27841", "wp_69_Normalized"):
        spec = JsonSchema(by_id[sid]["schema"])
        reqs.append(
            Request(
                build_prompt(tok, schema_prompt(spec, "Give a short example.")),
                spec,
                params,
                rid=sid,
            )
        )
    return reqs


def run(name: str, reqs=None, **options):
    model, tok = model_and_tokenizer()
    with SpecWorker(model, tok, backend=backend(name), **options) as worker:
        return worker.run(reqs or requests()), worker


@functools.cache
def reference(name: str):
    return run(name, no_spec=True)[0]


class CheckedDrafter(GrammarAwareDrafter):
    """Compares every drafted tree's kept rows with a fresh ``fill_tree_bitmask``."""

    checked = 0

    def propose(self, batch):
        trees = super().propose(batch)
        for s, tree in zip(batch, trees):
            m = current_matcher(s)
            if m is None:
                continue
            rows, valid = self.draft_rows(s.rid, tree)
            fresh = allocate_token_bitmask(tree.num_nodes, m.info.vocab_size)
            fresh_valid = m.fill_tree_bitmask(tree, fresh)
            assert torch.equal(valid, fresh_valid), (tree, valid, fresh_valid)
            assert torch.equal(rows, fresh), f"drafted rows differ from a fresh fill for {tree}"
            self.checked += 1
        return trees


@pytest.mark.parametrize("name", BACKENDS)
def test_drafted_rows_equal_fresh_fill_and_are_reused(name):
    model, tok = model_and_tokenizer()
    from spec_grammar.worker.drafters import make_drafter

    drafters = [
        CheckedDrafter(
            NgramDrafter(num_draft_tokens=8), num_draft_tokens=8, constrain=True, forced=True
        ),
        CheckedDrafter(
            make_drafter("self:2", target_model=model, topk=2, num_steps=3, num_draft_tokens=7),
            num_draft_tokens=7,
            constrain=True,
            forced=True,
        ),
    ]
    ref = reference(name)
    b = backend(name)
    fills = []
    original = b.fill_tree_bitmasks

    def counting(jobs, bitmask):  # instrumentation only: the real fill still runs
        fills.extend(jobs)
        return original(jobs, bitmask)

    b.fill_tree_bitmasks = counting
    try:
        for d in drafters:
            # the budget off: a request it gates gets a root-only tree the worker fills itself
            results, _ = run(name, reqs=requests()[:2], draft=d, draft_budget=False)
            assert d.checked >= 4
            assert [r.token_ids for r in results] == [r.token_ids for r in ref[:2]]
    finally:
        del b.fill_tree_bitmasks
    assert fills == [], "the worker re-filled rows the drafter had already computed"


@pytest.mark.parametrize("name", BACKENDS)
def test_greedy_outputs_identical_across_drafting_modes(name):
    ref = reference(name)
    modes = {
        "ngram+forced": dict(draft="ngram", forced_tokens=True, constrain_draft=False),
        "grammar": dict(draft="grammar"),
    }
    if name == "xgrammar":  # the other backends' constrained drafting is checked by the row test
        modes["ngram+constrain sync"] = dict(
            draft="ngram", constrain_draft=True, forced_tokens=False, overlap=False
        )
        modes["self+both"] = dict(
            draft="self:2",
            topk=2,
            num_steps=3,
            num_draft_tokens=7,
            constrain_draft=True,
            forced_tokens=True,
        )
    accept = {}
    for mode, opts in modes.items():
        results, _ = run(name, **opts)
        for req, r, base in zip(requests(), results, ref):
            assert r.token_ids == base.token_ids, (mode, req.rid)
            assert r.finish_reason == base.finish_reason
            assert replays(name, req.grammar, r.token_ids, r.finish_detail == "grammar")
        accept[mode] = sum(r.num_tokens for r in results) / sum(r.steps for r in results)
    # forced tokens alone must already draft something on tool calls
    assert accept["grammar"] > 1.0, accept


@pytest.mark.parametrize("name", [b for b in BACKENDS if b in ("xgrammar", "llguidance")])
def test_forced_tokens_go_through_verification(name):
    """The grammar forces the text "hello world"; a logit bias forbids the forced tokenization's
    first token, so the target writes the same text with other tokens: the drafted forced
    tokens must be rejected and the output must equal plain decoding under the same bias."""
    model, tok = model_and_tokenizer()
    spec = Regex(r"hello world [0-9]{2}")
    b = backend(name)
    m = b.matcher(b.compile(spec))
    forced = m.forced_tokens()
    assert len(forced) >= 2
    row = allocate_token_bitmask(1, b.vocab_size)
    m.fill_next_token_bitmask(row)
    assert int(unpack_bitmask(row, b.vocab_size).sum()) > 1  # other tokenizations are allowed
    params = SamplingParams(max_new_tokens=8, logit_bias={forced[0]: -1e4})
    reqs = [Request(build_prompt(tok, "Say hello world and a number."), spec, params, rid="biased")]
    ref, _ = run(name, reqs=reqs, no_spec=True)
    drafter = make_grammar_drafter("grammar", num_draft_tokens=8)
    out, _ = run(name, reqs=reqs, draft=drafter)
    assert drafter.forced_added > 0
    assert out[0].token_ids == ref[0].token_ids
    assert out[0].token_ids[0] != forced[0]
    assert re.fullmatch(r"hello world [0-9]{2}", out[0].text) or out[0].finish_reason == "length"
    assert out[0].text.startswith("hello world"), out[0].text


def test_draft_vocab_translation_with_a_synthetic_d2t_map():
    _, tok = model_and_tokenizer()
    b = backend("xgrammar")
    m = b.matcher(
        b.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    )
    rows = allocate_token_bitmask(2, b.vocab_size)
    m.fill_next_token_bitmask(rows, 0)
    m.accept_tokens(tok.encode('{"a": 1'))
    m.fill_next_token_bitmask(rows, 1)
    gen = torch.Generator().manual_seed(0)
    # a "hot" draft vocabulary: 1000 target ids, including some allowed ones, in random order
    allowed = unpack_bitmask(rows, b.vocab_size)
    hot = torch.cat(
        [
            allowed[0].nonzero().flatten()[:20],
            allowed[1].nonzero().flatten()[:20],
            torch.randperm(b.vocab_size, generator=gen)[:960],
        ]
    )
    hot = hot[torch.randperm(len(hot), generator=gen)]
    d2t = hot - torch.arange(len(hot))
    draft_rows = draft_vocab_bitmask(rows, d2t, b.vocab_size)
    assert draft_rows.shape == (2, (len(hot) + 31) // 32)
    dense = unpack_bitmask(draft_rows, len(hot))
    assert torch.equal(dense, allowed[:, hot])
    assert dense.any(dim=1).all()
    with pytest.raises(DraftVocabError, match="d2t"):
        check_draft_vocab(len(hot), b.vocab_size, None)
    with pytest.raises(DraftVocabError):
        draft_vocab_bitmask(rows, d2t[:-1] + 10**6, b.vocab_size)
    check_draft_vocab(b.vocab_size, b.vocab_size, None)


class PerRowReference(ModelDrafter):
    """The host path the batched top-k replaced: every row's whole log-softmax copied to the
    host, masked there with its unpacked grammar row, then ``torch.topk`` per row."""

    rows_seen = 0

    def top_log_probs(self, rows, k, bitmask=None, masked=None):
        allowed = {}
        if bitmask is not None:
            dense = unpack_bitmask(bitmask, rows.shape[1])
            allowed = dict(zip(range(rows.shape[0]) if masked is None else masked, dense))
        values, indices = [], []
        for j, row in enumerate(rows):
            lp = torch.log_softmax(row.float(), dim=-1).cpu()
            if j in allowed:
                lp = lp.masked_fill(~allowed[j], float("-inf"))
            top = torch.topk(lp, min(k, lp.shape[0]))
            values.append(top.values)
            indices.append(top.indices)
        self.rows_seen += rows.shape[0]
        return torch.stack(values), torch.stack(indices)


def test_batched_device_topk_equals_per_row_host_reference():
    """The batched on-device log-softmax/mask/top-k drafts exactly the trees of the per-row host
    path, plain (EAGLE-2 trees) and grammar-constrained, on a mixed batch of 3 (two grammar
    requests, one without)."""
    model, tok = model_and_tokenizer()
    draft_model = truncated_model(model, 2)
    b = backend("xgrammar")
    reqs = requests()
    prompts = [reqs[0].prompt, reqs[2].prompt, build_prompt(tok, "Name three colours.")]

    def states(grammar: bool):
        out = []
        for i, ids in enumerate(prompts):
            spec = reqs[0].grammar if i == 0 else reqs[2].grammar if i == 1 else None
            m = b.matcher(b.compile(spec)) if grammar and spec is not None else None
            out.append(
                RequestState(
                    Request(ids, spec, rid=f"r{i}"), list(ids), SamplingParams(), matcher=m
                )
            )
        return out

    opts = {
        "topk": 3,
        "num_steps": 3,
        "num_draft_tokens": 7,
        "vocab_limit": model.config.vocab_size,
    }
    for grammar in (False, True):
        got, want = [], []
        for cls, trees in ((ModelDrafter, got), (PerRowReference, want)):
            drafter = cls(ModelRunner(draft_model), **opts)
            outer = (
                GrammarAwareDrafter(drafter, num_draft_tokens=7, constrain=True, forced=False)
                if grammar
                else drafter
            )
            trees.extend(draft_steps(outer, states(grammar), steps=3))
        assert drafter.rows_seen > 3 * 3  # the reference ran at every depth, several rows each
        assert got == want
        assert all(len(tokens) == 7 for step in got for tokens, _ in step), got
