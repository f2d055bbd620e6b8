"""Breaking tests for the measured grammar placement of CUDA-graph steps (inline after the
replay or in the grammar thread started right before it), the all-grammar full-tree fast path
of batched greedy verification. (The bench runner's on-device document edit is tested in
``test_bench_gpu.py``.)

Oracles: the same worker without overlap and plain constrained decoding (``no_spec``) on a
float64 model (temperature 0 outputs must be token-identical whatever the placement), the
per-request verification path, and the plain runner's logits.
"""

from __future__ import annotations

import functools
import math
import random
import threading
import time

import pytest
import torch
from emulated_graphs import ReplayEagerly, make_runner
from spec_grammar_xgrammar import XGrammarBackend, XGrammarMatcher

from spec_grammar import JsonSchema, Regex
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import GrammarStateError
from spec_grammar.tree import DraftTree
from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.batch_verify import GreedyRequest, verify_greedy_batch
from spec_grammar.worker.drafters import Drafter
from spec_grammar.worker.placement import GrammarPlacement
from spec_grammar.worker.runner import ModelRunner
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy

MAX_NEW = 14


# -- shared setup -------------------------------------------------------------------------------
@functools.cache
def tiny():
    """A tiny random Llama in float64 (no near-tie argmax flips between batch shapes) and the
    SmolLM2 tokenizer whose vocabulary it shares."""
    from spec_grammar.models import load_tokenizer
    from spec_grammar.testing.model_shapes import build_model

    torch.manual_seed(0)
    return build_model("tiny", "cpu", torch.float64), load_tokenizer("smollm2")


@functools.cache
def xgr_backend():
    model, tok = tiny()
    return XGrammarBackend(tok, vocab_size=model.config.vocab_size)


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


def mixed_requests(sampled: bool = True) -> list[Request]:
    """Grammar and plain requests, greedy and (optionally) sampled, different budgets (so
    requests finish, and drain, at different steps), a stop string."""
    reqs = [
        Request("JSON:", JsonSchema(SCHEMA), SamplingParams(max_new_tokens=MAX_NEW), rid="json"),
        Request(
            "Answer:", Regex(r"(yes|no|maybe)"), SamplingParams(max_new_tokens=MAX_NEW), rid="short"
        ),
        Request("Digits:", Regex(r"[0-9]{1,40}"), SamplingParams(max_new_tokens=5), rid="digits"),
        Request("Text:", None, SamplingParams(max_new_tokens=9, ignore_eos=True), rid="plain"),
        Request("More text:", None, SamplingParams(max_new_tokens=MAX_NEW), rid="plain2"),
    ]
    if sampled:
        reqs.append(
            Request(
                "JSON too:",
                JsonSchema(SCHEMA),
                SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3),
                rid="sampled",
            )
        )
        reqs.append(
            Request(
                "Words:",
                None,
                SamplingParams(max_new_tokens=7, temperature=1.0, seed=5),
                rid="sampled-plain",
            )
        )
    return reqs


class FixedPlacement(GrammarPlacement):
    """The placement forced to one side (True: thread, False: inline)."""

    def __init__(self, thread: bool):
        super().__init__()
        self.thread = thread

    def use_thread(self, units: int) -> bool:
        return self.thread


class ChainDrafter(Drafter):
    """Full trees of exactly ``num_draft_tokens`` nodes: a chain of the first ``k`` tokens of a
    known continuation then branches of junk, so every step has full trees (the fast path of
    batched verification) and accepts several tokens at once."""

    def __init__(self, continuations: dict[str, list[int]], num_draft_tokens: int, junk: int = 17):
        super().__init__(num_draft_tokens=num_draft_tokens)
        self.continuations = continuations
        self.junk = junk

    def propose(self, batch):
        out = []
        for s in batch:
            rest = self.continuations.get(s.rid, [])[len(s.output_ids) :]
            chain = rest[: (self.num_draft_tokens - 1) // 2]
            tokens = [s.root_token] + chain
            parents = [-1] + list(range(len(chain)))
            while len(tokens) < self.num_draft_tokens:
                parents.append(len(tokens) % max(1, len(chain) + 1))
                tokens.append(self.junk + len(tokens))
            out.append(DraftTree(tokens, parents))
        return out


def outcome(results):
    return {r.rid: (r.token_ids, r.finish_reason) for r in results}


def run_worker(reqs, *, graphs: bool, placement=None, **kw):
    model, tok = tiny()
    runner = make_runner(model, "emulated") if graphs else ModelRunner(model)
    kw.setdefault("backend", xgr_backend())
    kw.setdefault("draft", "ngram")
    kw.setdefault("num_draft_tokens", 6)
    with SpecWorker(runner, tok, placement=placement, **kw) as worker:
        got = worker.run(reqs)
        flags = [s.grammar_in_thread for s in worker.step_stats]
    return outcome(got), flags


@functools.cache
def reference_greedy():
    """Plain constrained decoding of the greedy requests, without overlap."""
    reqs = [r for r in mixed_requests(sampled=False)]
    return run_worker(reqs, graphs=False, no_spec=True, overlap=False)[0]


# -- placement policy ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0])
def test_placement_survives_a_nonfinite_or_negative_measurement(bad):
    """A bad measurement (NaN, inf, negative) is refused with ValueError or forgotten: it must
    not poison the moving averages for good (afterwards the policy follows valid data)."""
    p = GrammarPlacement(explore_every=1000, alpha=1.0)
    for args in ((True, 10, bad, 0.5), (True, 10, 1.0, bad)):
        try:
            p.record(*args)
        except ValueError:
            pass
    # valid measurements (alpha 1: each replaces the last): thread 0.01 ms/unit, inline 1 ms/unit
    p.record(True, 10, grammar_ms=0.1, launch_ms=0.5)
    p.record(False, 10, grammar_ms=10.0, launch_ms=0.5)
    for thread in (True, False):
        assert (
            p.unit_ms[thread] is not None
            and math.isfinite(p.unit_ms[thread])
            and p.unit_ms[thread] >= 0
        )
    assert p.launch_ms is not None and math.isfinite(p.launch_ms) and p.launch_ms >= 0
    assert p.use_thread(10) is True  # max(0.5, 0.1) < 0.5 + 10


def test_placement_zero_units_and_zero_times():
    p = GrammarPlacement(explore_every=3, alpha=0.5)
    p.record(True, 0, grammar_ms=0.0, launch_ms=0.0)
    assert p.unit_ms == {True: None, False: None} and p.launch_ms == 0.0
    p.record(True, 4, grammar_ms=0.0, launch_ms=0.0)
    p.record(False, 4, grammar_ms=0.0, launch_ms=0.0)
    assert [p.use_thread(u) for u in (0, 1, 5, 0, 1, 5)] in (
        [False, False, True, False, False, True],
        [True, True, False, True, True, False],
    )


# -- batched greedy verification: the full-tree fast path ---------------------------------------
VOCAB = 70


def _rows(rng: random.Random, n: int) -> torch.Tensor:
    mask = allocate_token_bitmask(n, VOCAB)
    for r in range(n):
        allowed = (
            [] if rng.random() < 0.15 else [t for t in range(VOCAB) if rng.random() < 0.5 or t < 4]
        )
        mask[r] = 0
        for t in allowed:
            mask[r, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)
    return mask


@pytest.mark.parametrize("seed", range(12))
def test_fast_path_with_offsets_not_in_batch_order(seed):
    """``offsets`` are per batch index: request 0's rows may follow request 1's in the bitmask.
    The all-grammar full-tree fast path must mask each logits row with ITS request's rows, as
    the per-request oracle does."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, n = rng.randint(2, 4), rng.randint(2, 6)
    trees = []
    for _ in range(b):
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        trees.append(DraftTree([rng.randrange(8) for _ in range(n)], parents))
    logits = torch.randint(-3, 4, (b, n, VOCAB)).double().float()
    perm = list(range(b))
    while perm == list(range(b)):
        rng.shuffle(perm)
    offsets = [perm[i] * n for i in range(b)]  # request i's rows sit in slot perm[i]
    bitmask = _rows(rng, b * n)
    valids = [torch.tensor([rng.random() < 0.8 for _ in range(n)]) for _ in range(b)]
    stops = [frozenset({rng.randrange(8)}) for _ in range(b)]
    requests = [GreedyRequest(i, offsets[i], valids[i], stops[i]) for i in range(b)]
    got, _ = verify_greedy_batch(logits, trees, requests, bitmask=bitmask)
    for i in range(b):
        rows = bitmask[offsets[i] : offsets[i] + n]
        processed = process_tree_logits(
            logits[i], trees[i], [trees[i].token_list[0]], SamplingParams(), bitmask=rows
        )
        try:
            want = verify_greedy(processed, trees[i], valids[i], stop_token_ids=stops[i])
        except GrammarStateError as e:
            want = type(e)
        have = type(got[i]) if isinstance(got[i], GrammarStateError) else got[i]
        assert have == want, (i, offsets, have, want)


# -- the worker: outputs never depend on the placement ------------------------------------------
WORKER_OPTIONS = {
    "default": {},
    "2-threads": dict(grammar_threads=2),
    "constrained-draft": dict(constrain_draft=True, forced_tokens=True),
}


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
@pytest.mark.parametrize("options", list(WORKER_OPTIONS))
@pytest.mark.parametrize("placement", ["thread", "inline", "measured"])
def test_placements_are_token_identical(placement, options):
    """Emulated CUDA graphs with the grammar work forced into the thread, forced inline, or
    chosen by the policy (exploring every 2nd step): the same tokens and finish reasons as the
    same worker without overlap (sampled requests included, same seeds) and, for greedy
    requests, as plain constrained decoding."""
    reqs = mixed_requests()
    policy = {
        "thread": FixedPlacement(True),
        "inline": FixedPlacement(False),
        "measured": GrammarPlacement(explore_every=2),
    }[placement]
    kw = WORKER_OPTIONS[options]
    got, flags = run_worker(reqs, graphs=True, placement=policy, **kw)
    want, _ = run_worker(mixed_requests(), graphs=False, overlap=False, **kw)
    assert got == want
    ref = reference_greedy()
    for rid, value in ref.items():
        assert got[rid] == value, rid
    if placement == "measured":
        assert True in flags and False in flags
    elif placement == "thread":  # steps without grammar work (plain requests left) run inline
        assert flags[0] is True
    else:
        assert not any(flags)


def test_all_plain_batch_with_graphs_has_no_grammar_units():
    """No grammar work at all (units 0): never placed in the thread, outputs as without overlap."""
    reqs = [r for r in mixed_requests() if r.grammar is None]
    got, flags = run_worker(reqs, graphs=True, placement=FixedPlacement(True))
    assert not any(flags)
    assert (
        got
        == run_worker(
            [r for r in mixed_requests() if r.grammar is None], graphs=False, overlap=False
        )[0]
    )


# inline in the unit lane; the grammar thread (seconds more) in the integration lane
@pytest.mark.parametrize(
    "thread",
    [
        pytest.param(True, id="thread", marks=pytest.mark.integration),
        pytest.param(False, id="inline"),
    ],
)
def test_full_trees_fast_path_in_the_worker(thread):
    """All-grammar batch with full trees every step (the fast verify path, no row indices), a
    known continuation drafted so that whole runs are accepted: equal to plain decoding."""
    reqs = [r for r in mixed_requests(sampled=False) if r.grammar is not None]
    ref = reference_greedy()
    conts = {r.rid: ref[r.rid][0] for r in reqs}
    got, _ = run_worker(
        reqs, graphs=True, placement=FixedPlacement(thread), draft=ChainDrafter(conts, 7)
    )
    for r in reqs:
        assert got[r.rid] == ref[r.rid], r.rid


def test_trees_past_the_graph_node_cap_run_eagerly_with_inline_grammar_work():
    """Trees over the graph node cap (64) run eagerly even with graphs: no replay, so the grammar
    work cannot start before one; a policy asking for the thread gets it inline, same tokens."""
    from spec_grammar.worker.runner import _MAX_GRAPH_NODES

    reqs = [r for r in mixed_requests(sampled=False) if r.grammar is not None]
    ref = reference_greedy()
    conts = {r.rid: ref[r.rid][0] for r in reqs}
    model, tok = tiny()
    runner = make_runner(model, "emulated")
    drafter = ChainDrafter(conts, _MAX_GRAPH_NODES + 1)
    with SpecWorker(
        runner, tok, backend=xgr_backend(), draft=drafter, placement=FixedPlacement(True)
    ) as worker:
        got = outcome(worker.run(reqs))
        flags = [s.grammar_in_thread for s in worker.step_stats]
    assert runner._graphs.launches == 0 and not any(flags)
    for r in reqs:
        assert got[r.rid] == ref[r.rid], r.rid


# -- faults: a failing grammar, a failing forward, a cancel -------------------------------------
class FlakyMatcher(XGrammarMatcher):
    """Raises from the tree fill (or from accepting committed tokens) once it holds
    ``fail_at`` tokens."""

    fail_at = 3
    where = "fill"

    def _fill_tree_bitmask(self, tree, bitmask, row_offset):
        if self.where == "fill" and self.num_accepted >= self.fail_at:
            raise RuntimeError("injected tree-fill fault")
        return super()._fill_tree_bitmask(tree, bitmask, row_offset)

    def _accept_token(self, token):
        if self.where == "accept" and self.num_accepted >= self.fail_at:
            raise RuntimeError("injected accept fault")
        return super()._accept_token(token)


class FlakyAcceptMatcher(FlakyMatcher):
    where = "accept"


class FlakyBackend(XGrammarBackend):
    """xgrammar whose matchers of the regex ``[0-9]{1,40}`` are ``flaky`` (the others sound)."""

    name = "flaky-xgrammar"
    flaky = FlakyMatcher

    def _matcher(self, compiled):
        import xgrammar as xgr

        cls = (
            self.flaky
            if getattr(compiled.spec, "pattern", None) == r"[0-9]{1,40}"
            else XGrammarMatcher
        )
        return cls(self, xgr.GrammarMatcher(compiled.native))


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
@pytest.mark.parametrize("where", ["fill", "accept"])
@pytest.mark.parametrize("mode", ["thread", "inline", "sync"])
def test_grammar_fault_ends_only_its_request_in_any_placement(mode, where):
    model, tok = tiny()
    backend = FlakyBackend(tok, vocab_size=model.config.vocab_size)
    backend.flaky = FlakyMatcher if where == "fill" else FlakyAcceptMatcher
    reqs = mixed_requests(sampled=False)
    reqs[2] = Request(
        "Digits:", Regex(r"[0-9]{1,40}"), SamplingParams(max_new_tokens=MAX_NEW), rid="digits"
    )
    if mode == "sync":
        got, _ = run_worker(reqs, graphs=False, overlap=False, backend=backend)
    else:
        got, _ = run_worker(
            reqs, graphs=True, placement=FixedPlacement(mode == "thread"), backend=backend
        )
    want, _ = run_worker(
        [r for r in mixed_requests(sampled=False) if r.rid != "digits"], graphs=False, overlap=False
    )
    assert got.pop("digits")[1] == "error"
    assert got == want


class RaiseAfterLaunch(ReplayEagerly):
    """Emulated replay that raises right after ``before_launch`` on launch ``fail_on``."""

    def __init__(self, fail_on: int):
        super().__init__()
        self.fail_on = fail_on

    def run(self, key, inputs, forward, *, before_launch=None):
        if self.launches + 1 == self.fail_on:
            if before_launch is not None:
                before_launch()
            self.launches += 1
            raise RuntimeError("injected replay fault")
        return super().run(key, inputs, forward, before_launch=before_launch)


class SlowGrammarWorker(SpecWorker):
    """A worker whose grammar work sleeps 0.2 s first while ``slow``, counting the works
    running in ``state["running"]``."""

    def __init__(self, *args, state: dict, **kw):
        super().__init__(*args, **kw)
        self.state, self.slow = state, True

    def grammar_work(self, *args):
        if not self.slow:
            return super().grammar_work(*args)
        self.state["running"] += 1
        try:
            time.sleep(0.2)  # still writing when the replay raises
            return super().grammar_work(*args)
        finally:
            self.state["running"] -= 1


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
def test_forward_fault_after_launch_waits_for_the_thread_and_the_worker_recovers():
    """The replay raises after the grammar thread started: the thread's work has ended before
    the error reaches the caller (it writes the step's bitmask buffer), and the same worker then
    runs the batch again exactly as a fresh one (the replay raises on launch 3 only)."""
    model, tok = tiny()
    runner = ModelRunner(model, graphs=RaiseAfterLaunch(fail_on=3))
    reqs = mixed_requests()
    state = {"running": 0, "running_at_raise": None}
    with SlowGrammarWorker(
        runner,
        tok,
        backend=xgr_backend(),
        draft="ngram",
        num_draft_tokens=6,
        placement=FixedPlacement(True),
        state=state,
    ) as worker:
        with pytest.raises(RuntimeError, match="injected replay fault"):
            try:
                worker.run(reqs)
            except RuntimeError:
                state["running_at_raise"] = state["running"]
                raise
        assert state["running_at_raise"] == 0
        assert runner.request_ids == []
        worker.slow = False
        again = outcome(worker.run(mixed_requests()))
    assert again == run_worker(mixed_requests(), graphs=False, overlap=False)[0]


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
@pytest.mark.parametrize("thread", [True, False], ids=["thread", "inline"])
def test_cancel_mid_run_with_graphs(thread):
    """Cancel from ``on_step`` (and from another thread while a step runs): the cancelled request
    keeps a prefix of its uncancelled output, the others are untouched."""
    model, tok = tiny()
    reqs = mixed_requests()
    want, _ = run_worker(mixed_requests(), graphs=False, overlap=False)
    runner = make_runner(model, "emulated")
    cancelled_from_thread = threading.Event()

    class CancellingWorker(SpecWorker):
        def grammar_work(self, *args):
            if len(self.step_stats) == 1 and not cancelled_from_thread.is_set():
                cancelled_from_thread.set()
                self.cancel("plain2")  # from the grammar thread (or inline), mid-step
            return super().grammar_work(*args)

    with CancellingWorker(
        runner,
        tok,
        backend=xgr_backend(),
        draft="ngram",
        num_draft_tokens=6,
        placement=FixedPlacement(thread),
    ) as worker:

        def on_step(stats, states):
            if len(worker.step_stats) == 2:
                worker.cancel("json")

        got = outcome(worker.run(reqs, on_step=on_step))
    for rid in ("json", "plain2"):
        tokens, reason = got.pop(rid)
        assert reason == "cancelled" and tokens == want[rid][0][: len(tokens)], rid
        want.pop(rid)
    assert got == want


def test_close_inside_on_step_with_graphs():
    """``close`` from ``on_step`` stops the grammar threads; the graph path must not crash on the
    missing pool (the non-graph path falls back to in-order work): outputs as without overlap."""
    reqs = mixed_requests(sampled=False)
    model, tok = tiny()
    runner = make_runner(model, "emulated")
    with SpecWorker(
        runner,
        tok,
        backend=xgr_backend(),
        draft="ngram",
        num_draft_tokens=6,
        placement=FixedPlacement(True),
    ) as worker:
        got = outcome(worker.run(reqs, on_step=lambda stats, states: worker.close()))
    assert got == run_worker(mixed_requests(sampled=False), graphs=False, overlap=False)[0]
