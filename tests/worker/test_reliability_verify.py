"""Attacks on the batched greedy verify (``verify_greedy_batch``, ``launch_masked_rows``,
``kernels.row_argmax``), the runner's ``forward_trees(with_argmax=True)`` and ``EarlyMask``.

Oracles: the per-request path ``process_tree_logits`` + ``verify_greedy`` (the module's stated
contract: "exactly verify_greedy over process_tree_logits"), non-speculative decoding
(``draft="none"``) at temperature 0, and the project rule that bad input gets a typed
:class:`~spec_grammar.errors.SpecGrammarError`. Real tiny model, real SmolLM2 tokenizer, real
xgrammar backend and JSONSchemaBench schemas for the worker tests.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from emulated_graphs import make_runner

from spec_grammar import kernels
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import BitmaskError, GrammarStateError, SpecGrammarError
from spec_grammar.tree import DraftTree
from spec_grammar.worker.batch_verify import (
    GreedyRequest,
    launch_masked_rows,
    verify_greedy_batch,
)
from spec_grammar.worker.placement import EarlyMask
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy

V = 70  # not a multiple of 32
CHAIN = DraftTree([1, 2, 3], [-1, 0, 1])


def oracle(logits, tree, bitmask, valid, stops=()):
    processed = process_tree_logits(
        logits, tree, [tree.token_list[0]], SamplingParams(), bitmask=bitmask
    )
    try:
        return verify_greedy(processed, tree, valid, stop_token_ids=stops)
    except GrammarStateError as e:
        return type(e)


def plain(result):
    return type(result) if isinstance(result, GrammarStateError) else result


def all_allowed(rows: int, vocab: int = V) -> torch.Tensor:
    mask = allocate_token_bitmask(rows, vocab)
    mask[:] = -1
    return mask


def chain_logits() -> torch.Tensor:
    """``(1, 3, V)``: every row's maximum is the token of its child, so the walk goes deep."""
    logits = torch.zeros(1, 3, V)
    logits[0, 0, 2] = logits[0, 1, 3] = logits[0, 2, 9] = 5.0
    return logits


def forbid(mask: torch.Tensor, row: int, token: int) -> torch.Tensor:
    mask = mask.clone()
    mask[row, token // 32] &= ~(1 << (token % 32))
    return mask


# -- bugs: divergence from the per-request oracle ---------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
@pytest.mark.parametrize("row", [0, 1], ids=["root", "child"])
@pytest.mark.parametrize("grammar", [True, False], ids=["grammar", "plain"])
def test_nonfinite_logits_decide_as_the_oracle(value, row, grammar):
    """The oracle treats a row whose processed maximum is NaN or +inf as allowing no token
    (``isfinite(amax)``): a dead root raises, a dead child ends the walk with its token as the
    bonus. The batch path's ``row_argmax`` only marks all ``-inf`` rows, so it accepts."""
    logits = chain_logits()
    logits[0, row, 11] = value
    mask = all_allowed(3) if grammar else None
    got, _ = verify_greedy_batch(
        logits, [CHAIN], [GreedyRequest(0, 0 if grammar else None)], bitmask=mask
    )
    assert plain(got[0]) == oracle(logits[0], CHAIN, mask, None)


# -- bugs: unchecked arguments (silent wrong verdicts or untyped errors) ---------------------
@pytest.mark.parametrize(
    "valid",
    [
        torch.zeros(3, 1, dtype=torch.bool),
        torch.ones(2, dtype=torch.bool),
        torch.tensor([True, False, True, True]),
    ],
    ids=["2d-false", "short", "long"],
)
def test_node_validity_of_the_wrong_shape_is_refused(valid):
    """The oracle raises ``BitmaskError``; the batch path reads ``[[False]]`` as true (accepts
    invalid nodes), indexes past a short one (``IndexError``) or shifts a long one."""
    with pytest.raises(BitmaskError):
        oracle(chain_logits()[0], CHAIN, all_allowed(3), valid)
    with pytest.raises(BitmaskError):
        verify_greedy_batch(
            chain_logits(), [CHAIN], [GreedyRequest(0, 0, valid)], bitmask=all_allowed(3)
        )


def test_a_tree_larger_than_the_logits_rows_is_refused():
    """Request 0's 4-node tree against ``N_max = 3``: the batch path walks into request 1's
    logits rows (and ``_grammar_rows`` slice-assigns 4 rows into 3, shifting every later row)."""
    big = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2])
    logits = torch.cat([chain_logits(), chain_logits()])
    with pytest.raises(BitmaskError):
        verify_greedy_batch(
            logits, [big, CHAIN], [GreedyRequest(0, 0), GreedyRequest(1, 4)], bitmask=all_allowed(7)
        )


@pytest.mark.parametrize("length", [0, 7])
def test_masked_rows_of_the_wrong_length_are_refused(length):
    """``masked_rows`` must have one entry per bitmask row (3): a short one gives an
    ``IndexError`` in the verify, a long one is used as if it fit."""
    mask = forbid(all_allowed(3), 0, 2)  # the root's greedy token is forbidden
    with pytest.raises(BitmaskError):
        verify_greedy_batch(
            chain_logits(),
            [CHAIN],
            [GreedyRequest(0, 0)],
            bitmask=mask,
            masked_rows=torch.zeros(length, dtype=torch.long),
        )


def test_masked_rows_of_another_bitmask_never_commit_a_forbidden_token():
    """Early rows computed from a stale bitmask (the ring reused, a caller mix-up): the verify
    takes them on trust and returns token 2, which this step's grammar forbids at the root.
    One host word per resolved row would catch it."""
    logits = chain_logits()
    mask = forbid(all_allowed(3), 0, 2)
    stale = launch_masked_rows(logits, all_allowed(3), [CHAIN], [0])
    try:
        got, _ = verify_greedy_batch(
            logits, [CHAIN], [GreedyRequest(0, 0)], bitmask=mask, masked_rows=stale
        )
    except BitmaskError:
        return
    assert got[0] == oracle(logits[0], CHAIN, mask, None)


def test_duplicate_selected_indices():
    """``selected=[0, 0]`` works while no greedy token is forbidden, but with one the duplicate
    rows reach ``masked_argmax`` and fail with "indices must be distinct, got [0, 0]" (an error
    about an internal argument). Either the oracle's answer or an error naming ``selected``."""
    logits, mask = chain_logits(), forbid(all_allowed(3), 0, 2)
    try:
        got, _ = verify_greedy_batch(
            logits, [CHAIN], [GreedyRequest(0, 0), GreedyRequest(0, 0)], bitmask=mask
        )
    except SpecGrammarError as e:
        assert "selected" in str(e)
        return
    assert got == {0: oracle(logits[0], CHAIN, mask, None)}


@pytest.mark.parametrize(
    "case",
    ["selected-out-of-range", "row-argmax-wrong-shape", "bitmask-1d", "zero-width-bitmask"],
)
def test_bad_arguments_raise_typed_errors(case):
    """Today: ``IndexError`` / ``RuntimeError``. The zero-width bitmask (no token allowed) is
    ``GrammarStateError`` in the oracle but ``RuntimeError`` from ``masked_argmax_torch``."""
    logits = chain_logits()
    kw: dict = dict(bitmask=all_allowed(3))
    selected = [0]
    if case == "selected-out-of-range":
        selected = [1]
    elif case == "row-argmax-wrong-shape":
        kw["row_argmax"] = torch.zeros(2, dtype=torch.long)
    elif case == "bitmask-1d":
        kw["bitmask"] = torch.full((9,), -1, dtype=torch.int32)
    else:
        kw["bitmask"] = torch.zeros(3, 0, dtype=torch.int32)
        assert oracle(logits[0], CHAIN, kw["bitmask"], None) is GrammarStateError
    try:
        requests = [GreedyRequest(i, 0 if i == 0 else None) for i in selected]
        got, _ = verify_greedy_batch(logits, [CHAIN], requests, **kw)
    except SpecGrammarError:
        return
    assert case == "zero-width-bitmask" and isinstance(got[0], GrammarStateError)


def test_launch_masked_rows_without_grammar_rows():
    """No grammar request: the index tensor of an empty row list is float32 and
    ``masked_argmax`` refuses it ("indices must be a 1-D int32/int64 tensor")."""
    out = launch_masked_rows(
        torch.randn(2, 3, V), torch.zeros(0, 3, dtype=torch.int32), [CHAIN, CHAIN], [None, None]
    )
    assert out is None or (out.dtype == torch.int64 and out.shape == (0,))


@pytest.mark.parametrize("bad", [float("nan"), 2.0, -1.0])
def test_early_mask_refuses_a_bad_verify_measurement(bad):
    """``record_verify`` takes anything ``float()`` accepts: a NaN share makes
    ``forbidden_share < min_share`` False for good, so the early pass is launched every step
    (and 2 / -1 push the share outside [0, 1]). The class promises ``ValueError`` on bad
    measurements, as ``record_forward`` / ``record_launch`` do."""
    early = EarlyMask()
    early.record_forward(5.0)
    with pytest.raises(ValueError):
        early.record_verify(bad)
    assert early.forbidden_share == 0.0 and not early.worth_it(0.0)


# -- held under attack: the batch path equals the oracle on adversarial valid inputs ---------
def _adversarial_case(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab = rng.choice([1, 31, 32, 33, 70, 200])
    words = (vocab + 31) // 32
    width = rng.choice([words, words, max(1, words - 1), words + 1])  # narrower / wider masks
    b = rng.randint(1, 5)
    trees = []
    for _ in range(b):
        n = rng.randint(1, 8)
        tokens = [rng.randrange(min(vocab, 4)) for _ in range(n)]
        for k in range(1, n):
            if rng.random() < 0.05:
                tokens[k] = rng.choice([-1, 10**6])  # invalid draft tokens
        trees.append(DraftTree(tokens, [-1] + [rng.randrange(i) for i in range(1, n)]))
    n_max = max(t.num_nodes for t in trees)
    logits = torch.tensor([-1.0, 0.0, 1.0])[torch.randint(0, 3, (b, n_max, vocab))]  # many ties
    for i, tree in enumerate(trees):
        for node in range(tree.num_nodes):
            kids = [c for c in tree.children(node) if 0 <= tree.token_list[c] < vocab]
            if kids and rng.random() < 0.7:
                logits[i, node, tree.token_list[rng.choice(kids)]] = 4.0
            if rng.random() < 0.1:
                logits[i, node] = float("-inf")
            elif rng.random() < 0.2:
                logits[i, node, torch.rand(vocab) < 0.7] = float("-inf")
    grammar = [i for i in range(b) if rng.random() < 0.7]
    rng.shuffle(grammar)  # bitmask rows not in batch order, sometimes with gaps
    offsets, rows = [None] * b, 0
    gaps = rng.random() < 0.2
    for i in grammar:
        rows += rng.randint(0, 2) if gaps else 0
        offsets[i] = rows
        rows += trees[i].num_nodes
    bitmask = None
    if grammar:  # random words: stray bits past the vocabulary included
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32)
        for r in range(rows):
            p = rng.random()
            if p < 0.1:
                bitmask[r] = 0
            elif p < 0.3:
                bitmask[r] = -1
    valids = [
        None if offsets[i] is None else torch.rand(t.num_nodes) < 0.85 for i, t in enumerate(trees)
    ]
    stops = [frozenset(rng.sample(range(vocab), min(vocab, rng.randint(0, 2)))) for _ in range(b)]
    selected = sorted(rng.sample(range(b), rng.randint(1, b)), reverse=rng.random() < 0.3)
    return logits, trees, bitmask, offsets, valids, stops, selected


# block 0 in the unit lane; the other blocks (seconds each) in the integration lane
@pytest.mark.parametrize(
    "block", [0, *(pytest.param(b, marks=pytest.mark.integration) for b in range(1, 4))]
)
def test_adversarial_valid_inputs_equal_the_oracle(block):
    for seed in range(block * 150, (block + 1) * 150):
        logits, trees, bitmask, offsets, valids, stops, selected = _adversarial_case(seed)
        early = launch_masked_rows(logits, bitmask, trees, offsets) if bitmask is not None else None
        for kw in ({}, {"row_argmax": kernels.row_argmax(logits)}, {"masked_rows": early}):
            requests = [GreedyRequest(i, offsets[i], valids[i], stops[i]) for i in selected]
            got, _ = verify_greedy_batch(logits, trees, requests, bitmask=bitmask, **kw)
            for i in selected:
                n = trees[i].num_nodes
                rows = None if offsets[i] is None else bitmask[offsets[i] : offsets[i] + n]
                assert plain(got[i]) == oracle(
                    logits[i, :n], trees[i], rows, valids[i], stops[i]
                ), (seed, i, kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_is_the_first_maximum_on_wide_tied_rows(dtype):
    torch.manual_seed(1)
    vocab = 49152
    logits = torch.zeros(2, 4, vocab, dtype=dtype)
    logits.scatter_(2, torch.randint(0, vocab, (2, 4, 20)), 3.0)
    first = (logits == logits.amax(-1, keepdim=True)).int().argmax(-1)
    assert torch.equal(kernels.row_argmax(logits), first)
    tree = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2])
    mask = torch.randint(-(2**31), 2**31 - 1, (8, vocab // 32), dtype=torch.int32)
    got, _ = verify_greedy_batch(
        logits, [tree, tree], [GreedyRequest(0, 0), GreedyRequest(1, 4)], bitmask=mask
    )
    for i in range(2):
        assert plain(got[i]) == oracle(logits[i], tree, mask[4 * i : 4 * i + 4], None)


# -- the runner and the worker on the real tiny model ------------------------------------------
@functools.cache
def setup():
    from spec_grammar.datasets import jsonschemabench_sample
    from spec_grammar.models import load_tokenizer
    from spec_grammar.testing.model_shapes import build_model

    torch.manual_seed(0)
    model = build_model("tiny", "cpu", torch.float32)
    return model, load_tokenizer("smollm2"), [r["schema"] for r in jsonschemabench_sample()]


def backend(cls=None):
    from spec_grammar_xgrammar import XGrammarBackend

    model, tok, _ = setup()
    return (cls or XGrammarBackend)(tok, vocab_size=model.config.vocab_size)


@pytest.mark.parametrize("graphs", [False, "emulated"])
def test_forward_argmax_in_request_order(graphs):
    """Requests out of row order, trees of 3 / 5 / 2 nodes (graph buckets padded to 8):
    ``row_argmax`` comes back in request order, equal to that of the returned logits."""
    runner = make_runner(setup()[0], graphs)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6, 7, 8, 9])):
        runner.add(rid, prompt)
    trees = [
        DraftTree([3, 5, 6], [-1, 0, 0]),
        DraftTree([5, 2, 2, 2, 2], [-1, 0, 1, 2, 3]),
        DraftTree([9, 1], [-1, 0]),
    ]
    logits, top = runner.forward_trees(["a", "c", "b"], trees, with_argmax=True)
    assert top.shape == (3, 5) and top.dtype == torch.int64
    assert torch.equal(top, kernels.row_argmax(logits))
    assert torch.equal(logits, runner.forward_trees(["a", "c", "b"], trees))


def _requests(schemas):
    from spec_grammar.specs import JsonSchema, Regex
    from spec_grammar.worker.request import Request

    p = SamplingParams
    return [
        Request('JSON: {"a": [1, 1, 1', JsonSchema(schemas[0]), p(max_new_tokens=30), rid="g0"),
        Request("JSON: [[[[", JsonSchema(schemas[5]), p(max_new_tokens=1), rid="len1"),
        Request("JSON: {{{{", JsonSchema(schemas[7]), p(max_new_tokens=2), rid="len2"),
        Request(
            "sampled",
            JsonSchema(schemas[1]),
            p(max_new_tokens=20, temperature=0.8, seed=3),
            rid="sampled",
        ),
        Request(
            "rep",
            JsonSchema(schemas[2]),
            p(max_new_tokens=20, repetition_penalty=1.3),
            rid="penalty",
        ),
        Request("plain plain plain", None, p(max_new_tokens=15, ignore_eos=True), rid="plain"),
        Request("stop", None, p(max_new_tokens=30, stop=["a"], ignore_eos=True), rid="stop"),
        Request("lp", Regex(r"[a-c]{1,6}"), p(max_new_tokens=10, logprobs=True), rid="logprobs"),
    ]


def _run(graphs=False, be=None, requests=None, **kw):
    from spec_grammar.worker.engine import SpecWorker

    model, tok, schemas = setup()
    with SpecWorker(make_runner(model, graphs), tok, backend=be or backend(), **kw) as w:
        return {
            r.rid: (r.token_ids, r.finish_reason, r.error)
            for r in w.run(requests or _requests(schemas))
        }


@functools.cache
def reference():
    return _run(draft="none", overlap=False)


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
@pytest.mark.parametrize(
    "kw",
    [
        dict(overlap=True),
        dict(overlap=False, grammar_threads=2),
        dict(graphs="emulated"),
        dict(graphs="emulated", grammar_threads=2),
        dict(graphs="emulated", constrain_draft=True, forced_tokens=True),
    ],
    ids=["overlap", "in-order-2threads", "graphs", "graphs-2threads", "graphs-constrained"],
)
def test_worker_greedy_outputs_equal_non_speculative(kw):
    """Greedy grammar / plain / penalized / logprobs requests mixed with a sampled one, some
    ending after 1-2 tokens: every greedy request writes the tokens of ``draft="none"``."""
    got = _run(draft="ngram", num_draft_tokens=8, **kw)
    ref = reference()
    assert {k: v for k, v in got.items() if k != "sampled"} == {
        k: v for k, v in ref.items() if k != "sampled"
    }
    assert got["sampled"][1:] == ("length", None)


def test_worker_nan_logits_batched_path_equals_per_request_path():
    """A model whose logit of one token is NaN in every row. Per-request path (a zero logit
    bias routes requests there): both requests end with "the processed row of node 0 allows no
    token". Batched path: the NaN token is committed, then tokens from all-NaN rows."""
    from spec_grammar.specs import Regex
    from spec_grammar.testing.model_shapes import build_model
    from spec_grammar.worker.request import Request

    _, tok, _ = setup()
    torch.manual_seed(0)
    model = build_model("tiny", "cpu", torch.float32)
    with torch.no_grad():
        model.lm_head.weight[tok.encode("7")[0]] = float("nan")

    def run(bias):
        from spec_grammar.worker.engine import SpecWorker

        reqs = [
            Request(
                "x", Regex(r"[0-9]{3}"), SamplingParams(max_new_tokens=5, logit_bias=bias), rid="re"
            ),
            Request(
                "y",
                None,
                SamplingParams(max_new_tokens=4, ignore_eos=True, logit_bias=bias),
                rid="plain",
            ),
        ]
        with SpecWorker(model, tok, backend=backend(), draft="ngram") as w:
            return {r.rid: (r.token_ids, r.finish_reason, r.error) for r in w.run(reqs)}

    assert run({}) == run({0: 0.0})


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
@pytest.mark.parametrize("position", [0, 8])
def test_worker_fill_fault_that_scribbles_its_rows_ends_only_its_request(position):
    """A matcher that allows everything in its rows, then raises from its 3rd tree fill; first
    or last in the batch, two grammar threads, emulated graphs. It ends with the error and keeps
    the tokens it committed before; every other request writes the reference tokens."""
    from spec_grammar_xgrammar import XGrammarBackend, XGrammarMatcher

    from spec_grammar.specs import Regex
    from spec_grammar.worker.request import Request

    fault = Regex(r"[a-z]+( [a-z]+)*")

    class Scribbler(XGrammarMatcher):
        fills = 0

        def _fill_tree_bitmask(self, tree, bitmask, row_offset):
            self.fills += 1
            if self.fills >= 3:
                bitmask[row_offset : row_offset + tree.num_nodes] = -1
                raise RuntimeError("injected")
            return super()._fill_tree_bitmask(tree, bitmask, row_offset)

    class Faulty(XGrammarBackend):
        def _matcher(self, compiled):
            m = super()._matcher(compiled)
            return Scribbler(self, m._m) if compiled.spec == fault else m

    def requests(with_fault):
        reqs = _requests(setup()[2])
        bad = Request("the sea", fault, SamplingParams(max_new_tokens=40), rid="bad")
        return reqs[:position] + [bad] + reqs[position:] if with_fault else reqs + [bad]

    clean = _run(draft="ngram", requests=requests(False), graphs="emulated", grammar_threads=2)
    got = _run(
        be=backend(Faulty),
        draft="ngram",
        requests=requests(True),
        graphs="emulated",
        grammar_threads=2,
    )
    bad = got.pop("bad")
    assert bad[1:] == (
        "error",
        "the grammar failed while filling the tree bitmask: RuntimeError: injected",
    )
    assert 0 < len(bad[0]) and clean["bad"][0][: len(bad[0])] == bad[0]
    clean.pop("bad")
    assert got == clean
