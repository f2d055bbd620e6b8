"""Batched greedy verification (one read-back, the mask applied only where the greedy token is
forbidden) against the per-request oracle
``process_tree_logits`` + ``verify_greedy``, on random trees, logits and grammar rows that
include invalid nodes, fully masked (terminated) rows, stop tokens and mixed batches."""

import random

import pytest
import torch

from spec_grammar import kernels
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import BitmaskError, GrammarStateError
from spec_grammar.tree import DraftTree
from spec_grammar.worker.batch_verify import (
    GreedyRequest,
    batch_greedy_eligible,
    launch_masked_rows,
    verify_greedy_batch,
)
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy

VOCAB = 70  # not a multiple of 32: the last mask word is partial


def _random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    # a small token range makes the argmax often match a child, so walks go deep
    tokens = [rng.randrange(8)] + [rng.randrange(8) for _ in range(n - 1)]
    return DraftTree(tokens, parents)


def _random_rows(rng: random.Random, n: int, dead_root: bool) -> torch.Tensor:
    mask = allocate_token_bitmask(n, VOCAB)
    for r in range(n):
        allowed = [t for t in range(VOCAB) if rng.random() < 0.5 or t < 4]
        if rng.random() < 0.15 or (r == 0 and dead_root):
            allowed = []  # a terminated node: its row allows nothing
        mask[r] = 0
        for t in allowed:
            mask[r, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)
    return mask


def _oracle(logits, tree, bitmask, valid, stops):
    processed = process_tree_logits(
        logits, tree, [tree.token_list[0]], SamplingParams(), bitmask=bitmask
    )
    try:
        return verify_greedy(processed, tree, valid, stop_token_ids=stops)
    except GrammarStateError as e:
        return type(e)


@pytest.mark.parametrize("full", [False, True], ids=["mixed", "full"])
@pytest.mark.parametrize("seed", range(40))
def test_batch_equals_per_request_oracle(seed, full):
    """``full``: every request has a grammar and a tree of ``N_max`` nodes and is verified (the
    path without row indices); else a random mix of sizes, grammars and selections."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b = rng.randint(1, 5)
    size = rng.randint(1, 9)
    trees = [_random_tree(rng, size if full else rng.randint(1, 9)) for _ in range(b)]
    n_max = max(t.num_nodes for t in trees)
    # low-resolution logits: ties are frequent, so first-index tie-breaking is exercised
    logits = torch.randint(-3, 4, (b, n_max, VOCAB)).float()
    grammar = [full or rng.random() < 0.7 for _ in range(b)]
    selected = [i for i in range(b) if full or rng.random() < 0.8]
    stops = [frozenset({rng.randrange(8)}) for _ in range(b)]
    parts, offsets, valids, rows = [], [], [], 0
    for i, tree in enumerate(trees):
        if grammar[i]:
            part = _random_rows(rng, tree.num_nodes, dead_root=rng.random() < 0.1)
            parts.append(part)
            offsets.append(rows)
            valids.append(torch.tensor([rng.random() < 0.8 for _ in range(tree.num_nodes)]))
            rows += tree.num_nodes
        else:
            offsets.append(None)
            valids.append(None)
    bitmask = torch.cat(parts) if parts else None
    # the masked rows queued early (the worker does it while a CUDA forward runs) or not
    early = launch_masked_rows(logits, bitmask, trees, offsets) if parts else None
    assert early is not None or not parts
    for masked_rows in (None, early):
        requests = [GreedyRequest(i, offsets[i], valids[i], stops[i]) for i in selected]
        got, _ = verify_greedy_batch(
            logits, trees, requests, bitmask=bitmask, masked_rows=masked_rows
        )
        assert sorted(got) == selected
        for i in selected:
            tree = trees[i]
            rows_i = (
                None if offsets[i] is None else bitmask[offsets[i] : offsets[i] + tree.num_nodes]
            )
            want = _oracle(logits[i, : tree.num_nodes], tree, rows_i, valids[i], stops[i])
            have = type(got[i]) if isinstance(got[i], GrammarStateError) else got[i]
            assert have == want, (i, tree, have, want)


def test_early_masked_rows_follow_the_bitmask_order_and_refuse_gaps():
    trees = [DraftTree([1, 2, 3], [-1, 0, 0]), DraftTree([4, 5], [-1, 0])]
    logits = torch.randn(2, 3, VOCAB)
    bitmask = _random_rows(random.Random(3), 5, dead_root=False)
    # request 1's rows first, then request 0's
    got = launch_masked_rows(logits, bitmask, trees, [2, 0])
    flat = logits.reshape(6, VOCAB)
    assert got.tolist() == kernels.masked_argmax(flat, bitmask, [3, 4, 0, 1, 2]).tolist()
    assert launch_masked_rows(logits, bitmask, trees, [3, 0]) is None  # row 2 belongs to no tree
    assert launch_masked_rows(logits, bitmask[:4], trees, [2, 0]) is None  # rows missing


def test_rows_past_the_mask_dead_rows_and_the_forwards_argmax():
    """Logits wider than the mask (the maximum past it is forbidden), rows of only -inf, rows
    whose maximum the grammar forbids, an explicitly passed ``row_argmax``: the oracle's
    answers."""
    rng = random.Random(7)
    torch.manual_seed(7)
    vocab, b, n = 80, 3, 5
    trees = [_random_tree(rng, n) for _ in range(b)]
    logits = torch.randint(-3, 4, (b, n, vocab)).float()
    logits[:, :, 70] = 9.0  # everyone's maximum, past the 64 tokens a 2-word mask covers
    logits[1, 2] = NEG_INF = float("-inf")
    logits[2, 0, 5] = NEG_INF
    bitmask = torch.randint(-(2**31), 2**31 - 1, (b * n, 2), dtype=torch.int32)
    bitmask[4] = 0  # a terminated node
    offsets = [i * n for i in range(b)]
    valids = [torch.ones(n, dtype=torch.bool) for _ in range(b)]
    stops = [frozenset()] * b
    for top in (None, kernels.row_argmax(logits)):
        requests = [GreedyRequest(i, offsets[i], valids[i], stops[i]) for i in range(b)]
        got, _ = verify_greedy_batch(logits, trees, requests, bitmask=bitmask, row_argmax=top)
        for i in range(b):
            want = _oracle(logits[i], trees[i], bitmask[i * n : (i + 1) * n], valids[i], stops[i])
            have = type(got[i]) if isinstance(got[i], GrammarStateError) else got[i]
            assert have == want, (i, have, want)


def test_grammar_rows_outside_the_bitmask_are_refused():
    trees = [DraftTree([1, 2], [-1, 0])]
    logits = torch.zeros(1, 2, VOCAB)
    with pytest.raises(BitmaskError, match="bitmask rows 1..2"):
        verify_greedy_batch(
            logits, trees, [GreedyRequest(0, offset=1)], bitmask=allocate_token_bitmask(2, VOCAB)
        )
    with pytest.raises(BitmaskError, match="need the step's bitmask"):
        verify_greedy_batch(logits, trees, [GreedyRequest(0, offset=0)])


def test_eligibility():
    assert batch_greedy_eligible(SamplingParams())
    for change in (
        dict(temperature=0.7),
        dict(repetition_penalty=1.1),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=0.5),
        dict(logit_bias={3: 1.0}),
        dict(logprobs=True),
    ):
        assert not batch_greedy_eligible(SamplingParams(**change)), change


@pytest.fixture(scope="module")
def tiny_worker_setup():
    from spec_grammar.datasets import jsonschemabench_sample
    from spec_grammar.models import load_tokenizer
    from spec_grammar.registry import get_backend
    from spec_grammar.testing.model_shapes import build_model

    torch.manual_seed(0)
    model = build_model("tiny", "cpu", torch.float32)
    tok = load_tokenizer("smollm2")
    backend = get_backend("xgrammar", tok, vocab_size=model.config.vocab_size)
    return model, tok, backend, [r["schema"] for r in jsonschemabench_sample()[:3]]


def _generate(setup, overlap: bool, bias: dict):
    from spec_grammar.specs import JsonSchema
    from spec_grammar.worker.engine import SpecWorker
    from spec_grammar.worker.request import Request

    model, tok, backend, schemas = setup
    params = SamplingParams(max_new_tokens=24, logit_bias=bias)
    reqs = [
        Request(f"JSON {i}:", JsonSchema(s), params, rid=f"r{i}") for i, s in enumerate(schemas)
    ]
    reqs.append(
        Request(
            "Text:",
            None,
            SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=bias),
            rid="p",
        )
    )
    with SpecWorker(
        model, tok, backend=backend, draft="ngram", num_draft_tokens=6, overlap=overlap
    ) as w:
        return [(r.token_ids, r.finish_detail) for r in w.run(reqs)]


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
def test_worker_batched_path_equals_per_request_path(tiny_worker_setup):
    """A zero logit bias changes no logit but routes requests through the per-request path:
    batched (overlap on and off) and per-request outputs must be identical."""
    batched = _generate(tiny_worker_setup, True, {})
    assert batched == _generate(tiny_worker_setup, False, {})
    assert batched == _generate(tiny_worker_setup, True, {0: 0.0})
    assert all(reason in ("grammar", "length") for _, reason in batched)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_child_row_whose_nonfinite_maximum_its_grammar_forbids_is_entered(bad):
    """A child row with a NaN / +inf logit on a forbidden token is alive once masked: the walk
    enters it as the per-request path does (the unmasked greedy token alone calls it dead)."""
    tree = DraftTree([1, 2], [-1, 0])
    logits = torch.zeros(1, 2, VOCAB)
    logits[0, 0, 2] = 5.0
    logits[0, 1, 60] = bad
    logits[0, 1, 5] = 3.0
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 2
    bitmask[1, 0] = 1 << 5  # token 60 forbidden
    want = _oracle(logits[0], tree, bitmask, None, ())
    assert want == ([0, 1], 5)
    got, _ = verify_greedy_batch(logits, [tree], [GreedyRequest(0, offset=0)], bitmask=bitmask)
    assert got[0] == want
