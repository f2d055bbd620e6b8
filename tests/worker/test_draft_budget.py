"""The per-step draft budget (:mod:`spec_grammar.worker.draft_budget`): its choice against a
brute-force search over every cut, its cost model against the function it measured, subtrees
against their definition, and the worker under it: greedy outputs equal plain decoding's,
and drafts that are never accepted stop being verified."""

import itertools
import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_grammar.errors import DraftTreeError
from spec_grammar.models import load_tokenizer
from spec_grammar.tree import DraftTree
from spec_grammar.worker.draft_budget import AcceptModel, DraftBudget, StepCostModel, node_gains
from spec_grammar.worker.drafters import Drafter
from spec_grammar.worker.engine import SpecWorker
from spec_grammar.worker.request import Request
from spec_grammar.worker.sampling import SamplingParams


def _random_tree(rng: random.Random, n: int) -> DraftTree:
    return DraftTree.from_parents(
        [rng.randrange(100) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)]
    )


def test_subtree_keeps_the_nodes_links_and_order():
    rng = random.Random(0)
    for _ in range(200):
        tree = _random_tree(rng, rng.randrange(1, 12))
        keep = [0] + [i for i in range(1, tree.num_nodes) if rng.random() < 0.6]
        keep = [i for i in keep if all(a in keep for a in _ancestors(tree, i))]
        sub = tree.subtree(keep)
        assert sub.token_list == [tree.token_list[i] for i in keep]
        for new, old in enumerate(keep[1:], start=1):
            assert keep[sub.parent_list[new]] == tree.parent_list[old]
    tree = DraftTree.chain(5, [6, 7, 8])
    with pytest.raises(DraftTreeError, match="without its parent"):
        tree.subtree([0, 2])
    with pytest.raises(DraftTreeError, match="ascending"):
        tree.subtree([0, 2, 1])
    with pytest.raises(DraftTreeError, match="ascending"):
        tree.subtree([1])


def test_subtree_takes_integer_tensors_and_refuses_other_values_with_its_error():
    """``keep`` as a tensor or numpy array means the same nodes as the list; floats, None and
    strings raise DraftTreeError (not a TypeError / RuntimeError from inside)."""
    tree = DraftTree.from_parents([5, 6, 7, 8], [-1, 0, 1, 0])
    want = tree.subtree([0, 1, 3])
    for keep in (torch.tensor([0, 1, 3]), np.array([0, 1, 3]), (0, 1, 3)):
        got = tree.subtree(keep)
        assert (got.token_list, got.parent_list) == (want.token_list, want.parent_list)
    for bad in ([0, 1.0], torch.tensor([0.0, 1.0]), None, "01", [0, 2**70]):
        with pytest.raises(DraftTreeError):
            tree.subtree(bad)


def _ancestors(tree: DraftTree, i: int) -> list[int]:
    out = []
    while tree.parent_list[i] != -1:
        i = tree.parent_list[i]
        out.append(i)
    return out


def test_cost_model_fits_the_line_it_measured_and_follows_a_change():
    cost = StepCostModel()
    assert cost.predict(4) is None
    cost.record(8, 80.0)
    assert cost.predict(8) == 80.0 and cost.predict(2) == 80.0 and cost.predict(16) == 160.0
    rng = random.Random(0)
    for _ in range(40):
        rows = rng.randrange(1, 33)
        cost.record(rows, 30.0 + 2.5 * rows)
    assert cost.predict(1) == pytest.approx(32.5, rel=0.05)
    assert cost.predict(40) == pytest.approx(130.0, rel=0.05)
    for _ in range(200):  # the host got twice as slow: the old steps are forgotten
        rows = rng.randrange(1, 33)
        cost.record(rows, 2 * (30.0 + 2.5 * rows))
    assert cost.predict(20) == pytest.approx(2 * 80.0, rel=0.02)
    stalled = cost.predict(20)
    cost.record(20, 50 * stalled)  # one stalled step moves it by at most its capped weight
    assert cost.predict(20) < 1.1 * stalled


def _expected_tokens(trees, keeps, q) -> float:
    total = 0.0
    for tree, keep in zip(trees, keeps):
        gains = node_gains(tree.subtree(keep), q)
        total += sum(gains)  # the root's 1.0 is the bonus token
    return total


@pytest.mark.parametrize("seed", range(6))
def test_budget_choice_is_the_best_cut_by_brute_force(seed):
    """Chains of up to 4 drafts for 3 requests, the cost model fed a flat-then-linear cost:
    the chosen cut maximises expected tokens per predicted millisecond among all (5^3) cuts,
    as an exhaustive search finds."""
    rng = random.Random(seed)
    floor, per_row, knee = rng.uniform(20, 60), rng.uniform(1, 12), rng.randrange(1, 8)

    def ms(rows: int) -> float:
        return floor + per_row * max(0, rows - knee)

    budget = DraftBudget(explore_every=10**9)
    budget.record_step(1, 10 * ms(1))  # the first, cold step: left out of the cost line
    for rows in range(1, 16):
        budget.record_step(rows, ms(rows))
    q = rng.uniform(0.05, 0.95)
    trees = [DraftTree.chain(1, [rng.randrange(50) for _ in range(4)]) for _ in range(3)]
    rids = ["a", "b", "c"]
    for rid, tree in zip(rids, trees):  # every request accepts a fraction q of its drafts
        for _ in range(200):
            accepted = 1 + sum(1 for _ in itertools.takewhile(lambda _: rng.random() < q, range(4)))
            budget.accept.record(rid, tree, list(range(accepted)))
    chosen = budget.choose(rids, trees, lambda counts: sum(counts))
    rates = {rid: budget.accept.rate(rid) for rid in rids}

    def value(counts) -> float:
        keeps = [list(range(c)) for c in counts]
        gain = sum(_expected_tokens([t], [k], rates[r]) for t, k, r in zip(trees, keeps, rids))
        return gain / budget.predict(sum(counts))

    best = max(value(c) for c in itertools.product(range(1, 6), repeat=3))
    assert value([t.num_nodes for t in chosen]) == pytest.approx(best, rel=1e-9)


def test_accept_model_tracks_each_request():
    model = AcceptModel()
    chain = DraftTree.chain(1, [2, 3, 4])
    for _ in range(30):
        model.record("good", chain, [0, 1, 2, 3])  # all three drafts accepted
        model.record("bad", chain, [0])  # the first draft refused
    assert model.rate("good") > 0.9 > 0.1 > model.rate("bad")
    model.forget("good")
    assert 0.1 < model.rate("good") < 0.9  # back to the batch-wide rate


class _WrongDrafter(Drafter):
    """Chains whose first token is never the one plain decoding writes next (``plain``: the
    plain outputs by request id), so every draft is refused."""

    name = "wrong"

    def __init__(self, plain: dict[str, list[int]], **kw):
        super().__init__(**kw)
        self.plain = plain
        self.calls = 0  # requests drafted, over all steps

    def propose(self, batch):
        self.calls += len(batch)
        trees = []
        for st in batch:
            ref = self.plain[st.rid]
            wrong = (ref[min(len(st.output_ids), len(ref) - 1)] + 1) % 64
            trees.append(DraftTree.chain(st.root_token, [wrong] * (self.num_draft_tokens - 1)))
        return trees


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    # wide enough that a step's rows cost time (a draft row then has to pay for itself)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def _run(model, drafter, budget: bool, no_spec: bool = False):
    reqs = [
        Request(
            [3 + i, 9, 17, 4],
            None,
            SamplingParams(max_new_tokens=40, ignore_eos=True),
            rid=f"r{i}",
        )
        for i in range(3)
    ]
    worker = SpecWorker(
        model,
        load_tokenizer("smollm2"),  # decodes the tiny model's ids
        backend=None,
        draft=drafter,
        draft_budget=budget,
        no_spec=no_spec,
    )
    with worker:
        out = worker.run(reqs)
    return [o.token_ids for o in out], worker.step_stats


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
def test_worker_stops_drafting_when_drafts_never_pay(tiny_model):
    """Drafts never accepted: after its measuring steps the budget verifies roots only (plain
    decoding) except on its exploration steps, and stops calling the drafter for requests
    whose drafts did not pay; greedy outputs equal plain decoding's and those with every draft
    verified."""
    plain, _ = _run(tiny_model, None, budget=False, no_spec=True)
    by_rid = {f"r{i}": ids for i, ids in enumerate(plain)}
    fixed, fixed_steps = _run(tiny_model, _WrongDrafter(by_rid, num_draft_tokens=5), budget=False)
    drafter = _WrongDrafter(by_rid, num_draft_tokens=5)
    cut, steps = _run(tiny_model, drafter, budget=True)
    assert plain == fixed == cut and all(len(ids) == 40 for ids in plain)
    assert len(fixed_steps) == 40  # one token per step: every draft refused
    assert all(s.num_nodes == s.proposed_nodes for s in fixed_steps)
    busy = [s for s in steps if s.batch_size][5:]
    roots_only = [s for s in busy if s.num_nodes == s.batch_size]
    # over 35 steps the re-probes after 2, 4, 8 and 16 steps and the exploring steps (at most
    # every 16th) leave up to ~8 steps with drafts
    assert len(roots_only) >= 0.7 * len(busy)
    # the drafter ran for the first steps' requests and then mostly not (exploration only)
    assert len(steps) * 3 > drafter.calls >= 3 * 2
    assert sum(s.proposed_nodes > s.batch_size for s in busy) <= 0.3 * len(busy)
    assert all(s.proposed_nodes >= s.num_nodes for s in busy)
    assert all(s.predicted_ms is not None and s.forward_rows == s.num_nodes for s in busy)
    assert steps[0].predicted_ms is None and steps[1].predicted_ms is None  # cold, then first


def test_fixed_trees_are_kept_whole():
    """A sampled request's tree (``fixed``) is verified whole even when the budget cuts every
    other tree to its root (drafts never accepted, every row costly)."""
    budget = DraftBudget(explore_every=10**9)
    for rows in (2, 2, 30):  # the first, cold step is not measured
        budget.record_step(rows, 10.0 * rows)
    trees = [DraftTree.chain(1, [2, 3, 4, 5]) for _ in range(2)]
    for _ in range(50):
        budget.accept.record("a", trees[0], [0])
        budget.accept.record("b", trees[1], [0])
    cut = budget.choose(["a", "b"], trees, sum, fixed=[False, True])
    assert cut[0].num_nodes == 1 and cut[1] is trees[1]


def test_cost_model_ignores_broken_timings_and_never_predicts_a_free_step():
    """A NaN / infinite measurement, or one whose square overflows, leaves the fit as it was
    (one would poison its sums for good); zero milliseconds (a coarse clock) predict a positive
    time, so the budget's choice (expected tokens over predicted ms) never divides by zero."""
    clean, fed = StepCostModel(), StepCostModel()
    for rows, ms in [(4, 10.0), (8, 14.0), (2, 8.0)]:
        clean.record(rows, ms)
        fed.record(rows, ms)
        fed.record(rows, float("inf"))
        fed.record(rows, float("nan"))
        fed.record(rows, -1.0)
    assert [fed.predict(r) for r in (1, 6, 30)] == [clean.predict(r) for r in (1, 6, 30)]
    # finite but so large that its square overflows the sums (1e200 ms, uncapped while one
    # shape is measured): it made the sum of squares infinite for good, no plane was fitted
    # again, and predictions stayed ~1e147 ms after 120 ordinary steps
    clean, fed = StepCostModel(), StepCostModel()
    for model in (clean, fed):
        model.record(4, 10.0)
    fed.record(8, 1e200)
    for rows, ms in [(4, 10.0), (8, 14.0), (2, 8.0)] * 40:
        clean.record(rows, ms)
        fed.record(rows, ms)
    assert [fed.predict(r) for r in (1, 6, 30)] == [clean.predict(r) for r in (1, 6, 30)]
    budget = DraftBudget()
    budget.record_step(2, 5.0)  # the cold first step: left out
    budget.record_step(2, 0.0)  # the first measured step measured nothing
    assert budget.predict(2) > 0 and budget.predict(9) > 0
    trees = [DraftTree.chain(1, [2, 3, 4]), DraftTree.chain(5, [6])]
    chosen = budget.choose(["a", "b"], trees, sum)
    for tree, sub in zip(trees, chosen):  # each a prefix of its chain, root kept
        assert sub.token_list == tree.token_list[: sub.num_nodes]


class _BrokenFor(Drafter):
    """Chains of token 5, broken for request "bad" in the way ``how`` says (a custom drafter's
    bug): a tree missing from the batch's list, a tree rooted at another token, no tree."""

    name = "broken"

    def __init__(self, how: str, **kw):
        super().__init__(**kw)
        self.how = how

    def propose(self, batch):
        trees = [DraftTree.chain(st.root_token, [5, 6]) for st in batch]
        for i, st in enumerate(batch):
            if st.rid == "bad" and len(st.output_ids) >= 2:
                if self.how == "missing":
                    return trees[:i] + trees[i + 1 :]
                trees[i] = None if self.how == "none" else DraftTree.chain(st.root_token + 1, [5])
        return trees


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
@pytest.mark.parametrize("how", ["missing", "wrong-root", "none"])
def test_a_drafter_breaking_its_contract_for_one_request_ends_only_that_request(tiny_model, how):
    """A drafter that returns too few trees, a tree not rooted at the request's last committed
    token, or no tree for one request: that request ends with a "drafting failed" error keeping
    its committed tokens (a prefix of its plain output); the others equal plain decoding (before
    the check: the batch's forward raised for everybody, or the request decoded from a wrong
    token)."""
    plain, _ = _run(tiny_model, None, budget=False, no_spec=True)
    reqs = [
        Request([3 + i, 9, 17, 4], None, SamplingParams(max_new_tokens=40), rid=rid)
        for i, rid in enumerate(["a", "bad", "c"])
    ]
    worker = SpecWorker(tiny_model, load_tokenizer("smollm2"), backend=None, draft=_BrokenFor(how))
    with worker:
        out = {o.rid: o for o in worker.run(reqs)}
    assert out["a"].token_ids == plain[0] and out["c"].token_ids == plain[2]
    bad = out["bad"]
    assert bad.finish_reason == "error" and bad.error.startswith("drafting failed: DraftTreeError")
    assert 2 <= len(bad.token_ids) < 40 and bad.token_ids == plain[1][: len(bad.token_ids)]
    assert worker.runner.request_ids == []


def test_cost_model_recovers_from_a_slow_first_step():
    """The first step carries one-time work (seen on SmolLM2 on CPU: 345 ms at 12 rows, then
    100 ms at 5): the line must not cross zero and stay there (each later measurement capped at
    twice a near-zero prediction). Afterwards the host's true line (70 + 3 ms per row) is
    measured at 1-2 rows; the prediction follows it, and drafts that are always accepted are
    verified again."""
    budget = DraftBudget(explore_every=10**9)
    budget.record_step(12, 345.0)
    budget.record_step(5, 100.0)
    assert budget.predict(2) > 10.0
    rng = random.Random(0)
    for _ in range(60):
        rows = rng.choice([1, 2])
        budget.record_step(rows, 70.0 + 3.0 * rows)
    assert budget.predict(2) == pytest.approx(76.0, rel=0.1)
    chain = DraftTree.chain(1, [2, 3, 4])
    for _ in range(30):
        budget.accept.record("a", chain, [0, 1, 2, 3])
    (kept,) = budget.choose(["a"], [chain], sum)
    assert kept.num_nodes == 4  # 4 tokens for ~82 ms beat 1 token for ~73 ms


def test_cost_model_fits_the_plane_in_rows_and_padded_rows():
    """Steps timed as ``30 + 2 * rows + 0.8 * padded`` (attention over the batch padded to its
    largest tree): the fit predicts shapes it never saw, so a request's first draft node is
    charged its padding (8 single tokens -> one 2-node tree: +1 row, +8 padded rows). With
    ``padded == rows`` on every step (a CUDA graph's bucket) it is the line in rows."""
    rng = random.Random(1)
    cost = StepCostModel()
    for _ in range(80):
        counts = [rng.choice([1, 1, 2, 3, 5]) for _ in range(rng.randrange(1, 9))]
        rows, padded = sum(counts), len(counts) * max(counts)
        cost.record(rows, 30.0 + 2.0 * rows + 0.8 * padded, padded)
    assert cost.predict(8, 8) == pytest.approx(30 + 16 + 6.4, rel=0.01)
    assert cost.predict(9, 16) == pytest.approx(30 + 18 + 12.8, rel=0.01)
    assert cost.predict(40, 64) == pytest.approx(30 + 80 + 51.2, rel=0.01)
    line = StepCostModel()
    for _ in range(40):
        rows = rng.randrange(1, 33)
        line.record(rows, 30.0 + 2.5 * rows, rows)
    assert line.predict(20) == pytest.approx(80.0, rel=0.01)
    assert line.predict(20, 20) == line.predict(20)


def test_budget_charges_a_first_draft_node_its_padding():
    """Steps timed as ``30 + rows + 0.8 * padded``; eight requests, one with a one-node draft
    accepted 60% of the time. Its node costs one row and widens attention from 8 to 16 query
    rows (+7.4 ms for ~0.6 expected tokens, against 44.4 ms for 8): it is cut. Seen through
    rows alone (+1.8 ms) it would be verified. When every request drafts a node the padding is
    used and the nodes are verified."""
    rng = random.Random(2)
    budget = DraftBudget(explore_every=10**9)
    budget.record_step(8, 500.0, 8)  # cold
    for _ in range(60):
        counts = [rng.choice([1, 2, 4]) for _ in range(8)]
        rows, padded = sum(counts), 8 * max(counts)
        budget.record_step(rows, 30.0 + rows + 0.8 * padded, padded)
    rids = [f"r{i}" for i in range(8)]
    chain = DraftTree.chain(1, [2])
    for rid in rids:
        for _ in range(200):
            budget.accept.record(rid, chain, [0, 1] if rng.random() < 0.6 else [0])
    assert all(budget.accept.rate(r) > 0.4 for r in rids)

    def shape(counts):
        return sum(counts), len(counts) * max(counts)

    one = [chain] + [DraftTree.chain(1, [])] * 7
    assert [t.num_nodes for t in budget.choose(rids, one, shape)] == [1] * 8
    assert budget.choose(rids, one, sum)[0].num_nodes == 2  # attention term hidden
    assert [t.num_nodes for t in budget.choose(rids, [chain] * 8, shape)] == [2] * 8


def test_cost_model_fits_drafting_and_tree_fill_terms():
    """Steps timed as ``20 + 2 * rows + 0.5 * fill + 3 * drafted``: the fit separates what a
    drafted request and a filled grammar row cost from the forward's rows, and predicts
    shapes it never saw (a plain step where nothing was drafted)."""
    rng = random.Random(3)
    cost = StepCostModel()
    for _ in range(80):
        rows = rng.randrange(8, 30)
        fill, drafted = rng.randrange(0, rows + 1), rng.randrange(0, 9)
        cost.record(rows, 20.0 + 2.0 * rows + 0.5 * fill + 3.0 * drafted, rows, fill, drafted)
    assert cost.draft_ms == pytest.approx(3.0, rel=0.01)
    assert cost.predict(8, 8, 0, 0) == pytest.approx(36.0, rel=0.01)
    assert cost.predict(40, 40, 40, 8) == pytest.approx(20 + 80 + 20 + 24, rel=0.01)


def _drafting_steps(budget, rids, pays, steps, ms_of):
    """``steps`` steps of chains of 2 drafts: request ``r`` drafts when the budget says so and
    accepts both drafts when ``pays[r]``, none otherwise. Returns per step the requests that
    drafted."""
    shape = _padded_shape
    drafted_log = []
    for _ in range(steps):
        drafts = budget.drafting(rids, shape)
        trees = [DraftTree.chain(1, [2, 3]) if d else DraftTree.chain(1, []) for d in drafts]
        kept = budget.choose(rids, trees, shape, drafted=drafts)
        for rid, tree in zip(rids, kept):
            accepted = list(range(tree.num_nodes)) if pays[rid] else [0]
            budget.record_accept(rid, tree, accepted)
        rows, padded = shape([t.num_nodes for t in kept])
        budget.record_step(rows, ms_of(rows, padded, sum(drafts)), padded, 0, sum(drafts))
        drafted_log.append({r for r, d in zip(rids, drafts) if d})
    return drafted_log


def _padded_shape(counts):
    return sum(counts), len(counts) * max(counts)


def test_requests_whose_drafts_do_not_pay_are_not_drafted():
    """Four requests, one whose drafts are always accepted: after a few steps the other three
    are no longer drafted (no drafter call) except on exploring steps, the good one always
    is; with no good request the whole batch goes plain. Exploration's predicted extra stays
    within its share of the measured time (plus one exploring step's own)."""
    rids = ["good", "b1", "b2", "b3"]

    def ms_of(rows, padded, drafted):
        return 40.0 + 2.0 * rows + 1.0 * padded + 1.5 * drafted

    budget = DraftBudget(explore_every=8)
    log = _drafting_steps(
        budget, rids, {"good": True, "b1": False, "b2": False, "b3": False}, 200, ms_of
    )
    late = log[20:]
    assert all("good" in d for d in late)
    assert sum(d == {"good"} for d in late) >= 0.85 * len(late)
    bound = budget.explore_share * budget._total_ms + 80.0
    assert budget._explore_ms <= bound

    plain = DraftBudget(explore_every=8)
    log = _drafting_steps(plain, rids, dict.fromkeys(rids, False), 200, ms_of)
    assert sum(not d for d in log[20:]) >= 0.85 * len(log[20:])


def test_new_request_is_a_probe_where_drafts_have_not_paid():
    """After 120 steps in which no draft was accepted, a new request is not drafted outright
    (it was: no history counted as a reason to draft): it is a probe, drafted only while
    exploration has room (here none: ``explore_share=0``); while drafts pay batch-wide, a new
    request drafts at once."""
    rids = ["a", "b", "c", "d"]

    def ms_of(rows, padded, drafted):
        return 40.0 + 2.0 * rows + 1.0 * padded + 1.5 * drafted

    budget = DraftBudget(explore_every=10**9, explore_share=0.0)
    log = _drafting_steps(budget, rids, dict.fromkeys(rids, False), 120, ms_of)
    assert sum(not d for d in log[20:]) >= 0.9 * len(log[20:])
    assert budget.drafting([*rids, "new"], _padded_shape) == [False] * 5

    paying = DraftBudget(explore_every=10**9, explore_share=0.0)
    _drafting_steps(paying, rids, dict.fromkeys(rids, True), 60, ms_of)
    assert paying.drafting([*rids, "new"], _padded_shape) == [True] * 5
