"""Attacks on the host-work policies of CUDA-graph steps (:mod:`spec_grammar.worker.placement`:
regret-bounded :class:`Exploration`, :class:`GrammarPlacement`, :class:`LazyGrammar`,
:class:`EarlyMask`) and on their use by the worker (``SpecWorker._lazy_requests``,
``_verify_step``), plus the ``lazy_grammar`` option of the Python API and the CLI.

Oracles: the exploration contract (tries at least ``every`` decisions apart, at most
``budget / every`` of regret per decision on average, never stopping while the options are
predicted equal, never raising), plain constrained decoding (``no_spec``) of a tiny float64
Llama at temperature 0 (no near-tie argmax flips between batch shapes) whatever the policies
choose, the same worker without overlap for sampled requests, and for requests whose grammar
fails: a prefix of their plain-decoding output holding every token committed before the fault.
CUDA graphs are emulated on CPU (``emulated_graphs.ReplayEagerly``), with GPU times of the
forward fed from adversarial sequences (zero, near zero, huge, flipping every step).
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
from emulated_graphs import ReplayEagerly
from spec_grammar_xgrammar import XGrammarBackend, XGrammarMatcher
from test_reliability_lazy import HostileDrafter
from test_reliability_placement import tiny

from spec_grammar import JsonSchema, Regex
from spec_grammar.worker import Request, SpecWorker, api
from spec_grammar.worker.placement import (
    EarlyMask,
    Exploration,
    GrammarPlacement,
    LazyGrammar,
)
from spec_grammar.worker.runner import ModelRunner
from spec_grammar.worker.sampling import SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread while this file runs (restored after): the tiny model's matmuls are
    small, and on a busy 2-core host a second thread waiting for the other core made the file
    4x slower (36 s against 8.5 s, measured back to back)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


HOSTILE = [0.0, 1e-300, 1.0, 1e300, INF, -1.0, -INF, NAN]


# -- Exploration: hostile regrets and budgets ---------------------------------------------------
def _tries(e: Exploration, regret: float, budget: float, n: int) -> list[int]:
    """1-based decisions (of the next ``n``) at which ``e`` tries the other option."""
    return [k for k in range(1, n + 1) if e.due(regret, budget)]


@pytest.mark.parametrize("budget", HOSTILE)
@pytest.mark.parametrize("regret", HOSTILE)
def test_exploration_never_raises_nor_tries_in_a_tight_loop(regret, budget):
    """Whatever the regret and budget (a prediction that overflowed to inf, inf - inf = NaN,
    a negative time): ``due`` returns a bool and tries stay at least ``every`` apart."""
    e = Exploration(every=5)
    got = [e.due(regret, budget) for _ in range(200)]
    assert all(type(g) is bool for g in got)
    tries = [k for k, g in enumerate(got) if g]
    assert all(b - a >= 5 for a, b in itertools.pairwise([-1] + tries)), tries


@pytest.mark.parametrize("budget", HOSTILE)
@pytest.mark.parametrize("regret", [0.0, -1.0, -INF, NAN])
def test_exploration_never_stops_while_the_options_are_predicted_equal(regret, budget):
    """Regret 0 (or none: negative, or NaN when both predictions overflowed to inf) costs
    nothing: the other option is tried every ``every`` decisions whatever the budget. A NaN or
    negative budget used to stop exploration for good (``n * nan >= 0`` is never true), so a
    policy stayed with a stale estimate forever."""
    e = Exploration(every=5)
    assert _tries(e, regret, budget, 40) == [5, 10, 15, 20, 25, 30, 35, 40]


@pytest.mark.parametrize("budget", [NAN, -1.0, -INF, 0.0])
def test_exploration_without_budget_never_tries_a_slower_option(budget):
    e = Exploration(every=3)
    assert _tries(e, 0.5, budget, 300) == []
    # ... and still tries as soon as the options are predicted equal again
    assert _tries(e, 0.0, budget, 3) == [1]


def test_exploration_with_regret_flipping_every_decision_keeps_its_average_cost():
    """A regret jumping between 0 and 100 budgets every decision: tries land only on regret-0
    decisions (a try at regret 100 would need 100 * every decisions of waiting), at most one per
    ``every``; the average regret paid stays within ``budget / every`` per decision."""
    e = Exploration(every=4)
    budget, paid, tries = 0.01, 0.0, []
    for k in range(1, 4001):
        regret = 0.0 if k % 2 else 1.0
        if e.due(regret, budget):
            paid += regret
            tries.append(k)
    assert paid <= budget / 4 * 4000
    assert all(b - a >= 4 for a, b in itertools.pairwise(tries)) and len(tries) >= 4000 // 6


@pytest.mark.parametrize("every", [NAN, INF, 2.5, "50", None, 1, 0, -3, True])
def test_exploration_refuses_bad_spacing(every):
    """``every`` must be an int >= 2: NaN and inf used to be accepted (``nan < 2`` is False) and
    then never explored (``n >= nan`` is never true); a str raised a bare TypeError."""
    for make in (
        Exploration,
        lambda v: GrammarPlacement(explore_every=v),
        lambda v: LazyGrammar(explore_every=v),
    ):
        with pytest.raises(ValueError, match="explore_every"):
            make(every)


# -- the policies on adversarial measurement sequences ------------------------------------------
def test_placement_with_a_best_option_flipping_every_step_follows_it_and_explores_rarely():
    """Measurements that make the thread, then inline, predicted best on alternate steps (alpha
    1: each replaces the last): the policy follows the measurements, and picks the option not
    predicted best at most once per ``explore_every`` decisions."""
    p = GrammarPlacement(explore_every=10, explore_share=0.1, alpha=1.0)
    p.record(True, 10, grammar_ms=1.0, launch_ms=0.5)
    p.record(False, 10, grammar_ms=1.0, launch_ms=0.5)
    against = []
    for k in range(1000):
        fast_thread = k % 2 == 0
        p.record(True, 10, grammar_ms=0.2 if fast_thread else 9.0, launch_ms=0.5)
        p.record(False, 10, grammar_ms=9.0 if fast_thread else 0.2, launch_ms=0.5)
        best = p.predict(10, True) < p.predict(10, False)
        assert best == fast_thread
        if p.use_thread(10) != best:
            against.append(k)
    assert all(b - a >= 10 for a, b in itertools.pairwise(against)), against


def test_lazy_policy_with_a_best_mode_flipping_every_step_follows_it_and_explores_rarely():
    lazy = LazyGrammar(hide=0.75, slack=0.02, explore_every=8, alpha=1.0)
    lazy.record_fill(10, 1.0)
    lazy.record_lazy(2, 0.2)
    against = []
    for k in range(1000):
        fill_best = k % 2 == 0
        # 10 rows under a 10 ms forward: at 0.1 ms a row the fill hides (0.2 ms predicted: the
        # slack), at 10 ms a row it does not (100 - 7.5 ms exposed); the 2 lazy walks cost 2 ms
        lazy.record_fill(10, 1.0 if fill_best else 100.0)
        lazy.record_lazy(2, 2.0)
        if lazy.use_lazy(10, 2, 0.0, 10.0) == fill_best:
            against.append(k)
    assert against and all(b - a >= 8 for a, b in itertools.pairwise(against)), against


@pytest.mark.parametrize("forward", [0.0, 1e-12, 1e-6, 1e9, INF, NAN, -1.0])
@pytest.mark.parametrize("launch", [None, 0.0, 1e-9, 1e9, NAN])
def test_lazy_policy_decides_without_raising_on_extreme_times(forward, launch):
    """``use_lazy`` on a forward time (from EarlyMask) and launch time (from GrammarPlacement)
    near zero, huge, or not a number, with zero rows / zero requests: a bool every call, no
    exception inside the step that asks."""
    lazy = LazyGrammar(explore_every=2)
    lazy.record_fill(8, 0.4)
    lazy.record_lazy(2, 0.02)
    for rows, requests in [(0, 0), (0, 1), (8, 2), (10**6, 10**4)]:
        for _ in range(4):
            assert type(lazy.use_lazy(rows, requests, launch, forward)) is bool


def test_placement_with_overflowing_predictions_still_explores():
    """Per-unit costs so large that both predictions overflow to inf: the regret is
    ``inf - inf = NaN``. The policy must still try the other placement now and then (it used to
    stay inline forever: NaN regret made every try "not due")."""
    p = GrammarPlacement(explore_every=4, alpha=1.0)
    p.record(True, 1, grammar_ms=1e308, launch_ms=0.5)
    p.record(False, 1, grammar_ms=1e308, launch_ms=0.5)
    assert p.predict(10, True) == p.predict(10, False) == INF
    choices = [p.use_thread(10) for _ in range(12)]
    assert True in choices and False in choices


def test_zero_unit_and_zero_row_steps_leave_the_estimates_alone():
    """Steps with no grammar units / rows / lazy requests (all requests plain, or every request
    lazy): the launch time still averages, the per-unit / per-row / per-request costs stay
    unmeasured (no division by zero), and negative counts are ignored as zero."""
    p = GrammarPlacement(alpha=1.0)
    lazy = LazyGrammar(alpha=1.0)
    for units in (0, -3):
        p.record(True, units, grammar_ms=5.0, launch_ms=0.25)
        lazy.record_fill(units, 5.0)
        lazy.record_lazy(units, 5.0)
    assert p.unit_ms == {True: None, False: None} and p.launch_ms == 0.25
    assert lazy.row_ms is None and lazy.request_ms is None
    assert p.use_thread(0) is True  # the thread is measured first
    assert lazy.use_lazy(0, 0, 0.25, 1.0) is False  # the fill is measured first


def test_early_mask_on_zero_and_huge_forward_times():
    e = EarlyMask(alpha=1.0)
    e.record_verify(True)
    e.record_forward(0.0)
    assert e.worth_it(0.0) is False  # no forward time left to hide anything under
    e.record_forward(1e300)
    assert e.worth_it(1e6) is True
    e.record_launch(1e300)
    assert e.worth_it(0.0) is False  # remaining 1e300 ms is not 2x a 1e300 ms launch
    for since in (NAN, INF, -INF):
        assert type(e.worth_it(since)) is bool


# -- the worker: emulated CUDA graphs with adversarial GPU times --------------------------------
MAX_NEW = 12


class _Event:
    """A finished CUDA timing event whose elapsed time is given."""

    def __init__(self, ms: float):
        self.ms = ms

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return self.ms


class TimedReplay(ReplayEagerly):
    """Emulated replay that reports each forward's GPU milliseconds from ``times`` (what CUDA
    events around a real replay give ``ModelRunner.last_forward_gpu_ms``), so the lazy-grammar
    and early-mask policies see measured forwards on CPU."""

    def __init__(self, times):
        super().__init__()
        self.times = iter(times)

    def run(self, key, inputs, forward, *, before_launch=None):
        out = super().run(key, inputs, forward, before_launch=before_launch)
        self.last_events = (_Event(next(self.times)), _Event(0.0))
        return out


@functools.cache
def _backend() -> FaultBackend:
    model, tok = tiny()
    return FaultBackend(tok, vocab_size=model.config.vocab_size)


def xgr_backend() -> FaultBackend:
    """The shared xgrammar backend, disarmed (:class:`FaultBackend`)."""
    backend = _backend()
    backend.armed = False
    return backend


def timed_runner(times) -> ModelRunner:
    return ModelRunner(tiny()[0], graphs=TimedReplay(times))


def requests(sampled: bool = True, extra: tuple = ()) -> list[Request]:
    """Greedy grammar requests (JSON, a short regex that ends soon, letters the random model
    mostly refuses), plain ones (one ignoring EOS), optionally sampled ones, different budgets
    so requests finish and drain at different steps."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a"],
    }
    reqs = [
        Request("JSON:", JsonSchema(schema), SamplingParams(max_new_tokens=MAX_NEW), rid="json"),
        Request(
            "Answer:", Regex(r"(yes|no|maybe)"), SamplingParams(max_new_tokens=MAX_NEW), rid="short"
        ),
        Request(
            "Words:",
            Regex(r"[a-z]+( [a-z]+)*"),
            SamplingParams(max_new_tokens=MAX_NEW),
            rid="words",
        ),
        Request("Digits:", Regex(r"[0-9]{1,40}"), SamplingParams(max_new_tokens=5), rid="digits"),
        Request(
            "One:", Regex(r"[0-9]{1,40}"), SamplingParams(max_new_tokens=1), rid="one"
        ),  # root-only trees
        Request("Text:", None, SamplingParams(max_new_tokens=7, ignore_eos=True), rid="plain"),
    ]
    if sampled:
        reqs += [
            Request(
                "JSON too:",
                JsonSchema(schema),
                SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3),
                rid="sampled",
            ),
            Request(
                "More:",
                None,
                SamplingParams(max_new_tokens=6, temperature=1.0, seed=5),
                rid="sampled-plain",
            ),
        ]
    return reqs + [
        Request(p, g, SamplingParams(max_new_tokens=MAX_NEW), rid=r) for r, p, g in extra
    ]


def outcome(results) -> dict[str, tuple[list[int], str]]:
    return {r.rid: (r.token_ids, r.finish_reason) for r in results}


@functools.cache
def plain_reference() -> dict[str, tuple[list[int], str]]:
    """Plain constrained decoding (root-only trees, in order) of every greedy request, the
    faulty ones' grammars included (here with sound matchers)."""
    reqs = [r for r in requests(sampled=False, extra=FAULTY) if r.sampling.greedy]
    with SpecWorker(tiny()[0], tiny()[1], backend=xgr_backend(), no_spec=True, overlap=False) as w:
        return outcome(w.run(reqs))


def assert_plain(got: dict, what: str) -> None:
    ref = plain_reference()
    for rid, value in got.items():
        if rid in ref:
            assert value == ref[rid], (what, rid, value, ref[rid])


TIMES = {
    "zero": lambda: itertools.repeat(0.0),
    "flip": lambda: itertools.cycle([1e-9, 1e9]),
    "random": lambda: map(random.Random(7).choice, itertools.repeat([0.0, 1e-6, 0.3, 5.0, 1e6])),
}


@pytest.mark.parametrize("times", list(TIMES))
def test_measured_policies_on_adversarial_forward_times_equal_plain_decoding(times):
    """``lazy_grammar=None`` (the measured choice) on emulated graphs whose forwards take zero,
    flipping (near zero / huge) or random GPU times, every policy exploring every 2nd decision: the run
    completes, both lazy and fill steps happen, outputs equal plain decoding."""
    with SpecWorker(
        timed_runner(TIMES[times]()),
        tiny()[1],
        backend=xgr_backend(),
        draft="ngram",
        num_draft_tokens=6,
        lazy_policy=LazyGrammar(explore_every=2),
        placement=GrammarPlacement(explore_every=2),
        early_mask=EarlyMask(min_share=0.0),
    ) as w:
        lazy = []
        for _ in range(2):  # a second run starts from the first one's estimates
            assert_plain(outcome(w.run(requests(sampled=False))), times)
            lazy += [s.lazy_requests > 0 for s in w.step_stats]
    # (with a zero forward time the budget of a try is 0: once measured slower, the fill is
    # never tried again, as documented)
    assert True in lazy and False in lazy, lazy


# -- the worker: policies choosing at random, lazy and fill every other step ---------------------
class Coin:
    """A seeded coin (``seed``), or without a seed True on every call ``k`` (1-based) with
    ``k % period == hit``."""

    def __init__(self, seed, period, hit):
        self.rng = random.Random(seed) if seed is not None else None
        self.period, self.hit, self.calls = period, hit, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.rng.random() < 0.5 if self.rng else self.calls % self.period == self.hit


class CoinLazy(LazyGrammar):
    """The lazy-or-fill choice by a seeded coin (or alternating, lazy first)."""

    def __init__(self, seed):
        super().__init__()
        self.coin = Coin(seed, 2, 1)

    def use_lazy(self, rows, requests, launch_ms, forward_ms):
        return self.coin()


class CoinPlacement(GrammarPlacement):
    """Thread or inline by a seeded coin (or alternating, inline first)."""

    def __init__(self, seed):
        super().__init__()
        self.coin = Coin(seed, 2, 0)

    def use_thread(self, units):
        return self.coin()


class CoinEarlyMask(EarlyMask):
    """The early mask by a seeded coin (or every 3rd all-greedy step)."""

    def __init__(self, seed):
        super().__init__()
        self.coin = Coin(seed, 3, 0)

    def worth_it(self, since_launch_ms):
        return self.coin()


def coin_worker(seed, backend=None, drafter=None, **kw) -> SpecWorker:
    """A worker on emulated graphs whose three policies choose by coin (``seed``) or alternate
    (None); ``lazy_grammar=None`` so the lazy policy is asked every step."""
    kw.setdefault("draft", drafter or "ngram")
    kw.setdefault("num_draft_tokens", 6)
    return SpecWorker(
        timed_runner(itertools.repeat(1.0)),
        tiny()[1],
        backend=backend or xgr_backend(),
        lazy_policy=CoinLazy(seed),
        placement=CoinPlacement(seed),
        early_mask=CoinEarlyMask(seed),
        **kw,
    )


class FaultTolerantHostileDrafter(HostileDrafter):
    """``test_reliability_lazy.HostileDrafter`` (trees around each request's plain-decoding
    continuation: a wrong grammatical first branch that the lazy walk must roll back whole,
    stop tokens with children, duplicate siblings, ids outside the vocabulary) that drafts plain
    junk where the request's matcher fails while it looks for grammatical junk: the worker, not
    this test drafter, is under test."""

    def _grammar_junk(self, s, avoid):
        try:
            return super()._grammar_junk(s, avoid)
        except RuntimeError:
            return self.junk[:3]


def hostile_drafter(backend) -> HostileDrafter:
    ref = plain_reference()
    conts = {r.rid: ref.get(r.rid, ([], ""))[0] for r in requests(extra=FAULTY)}
    return FaultTolerantHostileDrafter(
        conts, backend.vocab_size, backend.tokenizer_info.stop_token_ids[0]
    )


OPTIONS = {
    "ngram": {},
    "hostile-drafts": {"drafter": "hostile"},
    "forced-tokens": {"forced_tokens": True},
    "constrained-draft": {"constrain_draft": True, "forced_tokens": True},
    "2-threads": {"grammar_threads": 2},
}


def _options(name: str, backend) -> dict:
    kw = dict(OPTIONS[name])
    if kw.pop("drafter", None):
        kw["drafter"] = hostile_drafter(backend)
    return kw


def sampled_reference(options: str) -> dict[str, tuple[list[int], str]]:
    """The sampled requests from the same drafting without overlap or graphs (same seeds; the
    grammar threads change no draft)."""
    return _sampled_reference("ngram" if options == "2-threads" else options)


@functools.cache
def _sampled_reference(options: str) -> dict[str, tuple[list[int], str]]:
    kw = _options(options, xgr_backend())
    kw["draft"] = kw.pop("drafter", "ngram")
    with SpecWorker(
        tiny()[0],
        tiny()[1],
        backend=xgr_backend(),
        num_draft_tokens=6,
        overlap=False,
        lazy_grammar=False,
        **kw,
    ) as w:
        got = outcome(w.run(requests()))
    return {rid: v for rid, v in got.items() if rid.startswith("sampled")}


@pytest.mark.parametrize("options, seed", [(o, None) for o in OPTIONS] + [("hostile-drafts", 1)])
def test_any_policy_choice_gives_plain_decoding(options, seed):
    """Lazy or fill, thread or inline, early mask or not, chosen by coin (or alternating) every
    step: greedy outputs equal plain decoding, sampled ones the same worker in order."""
    backend = xgr_backend()
    with coin_worker(seed, backend, **_options(options, backend)) as w:
        got = outcome(w.run(requests()))
        stats = list(w.step_stats)
    assert_plain(got, options)
    for rid, value in sampled_reference(options).items():
        assert got[rid] == value, (rid, got[rid], value)
    lazy = [s.lazy_requests > 0 for s in stats]
    if options != "constrained-draft":  # its trees keep their drafted rows: never lazy
        assert True in lazy and False in lazy, lazy


@pytest.mark.parametrize(
    "options",
    [{"no_spec": True}, {"overlap": False}, {"grammar_threads": 3}],
    ids=["no-spec", "in-order", "3-threads"],
)
def test_lazy_on_in_every_mode_gives_plain_decoding(options):
    """``lazy_grammar=True`` outside overlapped graph steps (plain CPU runner): in order (the
    lazy matchers advanced after the forward), with root-only trees, with several grammar
    threads: greedy outputs equal plain decoding, sampled grammar requests are filled."""
    model, tok = tiny()
    with SpecWorker(
        model,
        tok,
        backend=xgr_backend(),
        draft="ngram",
        num_draft_tokens=6,
        lazy_grammar=True,
        **options,
    ) as w:
        got = outcome(w.run(requests()))
        stats = list(w.step_stats)
    assert_plain(got, str(options))
    greedy_grammar = [r for r in requests() if r.grammar is not None and r.sampling.greedy]
    assert stats[0].lazy_requests == len(greedy_grammar)  # every one of them, the first step


def test_close_inside_on_step_while_lazy_and_fill_alternate():
    """``close`` from ``on_step`` every step (no grammar thread left: every step inline), the
    policies alternating: outputs as plain decoding."""
    with coin_worker(None) as w:
        got = outcome(w.run(requests(sampled=False), on_step=lambda stats, states: w.close()))
        lazy = [s.lazy_requests > 0 for s in w.step_stats]
    assert_plain(got, "close")
    assert True in lazy and False in lazy, lazy


# -- fault isolation while lazy and fill alternate ----------------------------------------------
class FaultMatcher(XGrammarMatcher):
    """A real xgrammar matcher whose ``hook`` raises once it holds ``at`` tokens or more."""

    hook, at, fired, faulty_forks = "", 0, None, False

    def _fault(self, hook: str) -> None:
        if hook == self.hook and self.num_accepted >= self.at:
            if self.fired is not None:
                self.fired.add(hook)
            raise RuntimeError(f"injected {hook} fault")

    def _accept_token(self, token):
        self._fault("accept")
        return super()._accept_token(token)

    def _rollback(self, num_tokens):
        self._fault("rollback")
        return super()._rollback(num_tokens)

    def _fill_next_token_bitmask(self, bitmask, row):
        self._fault("row")
        return super()._fill_next_token_bitmask(bitmask, row)

    def _fill_tree_bitmask(self, tree, bitmask, row_offset):
        self._fault("tree")
        return super()._fill_tree_bitmask(tree, bitmask, row_offset)

    def _is_terminated(self):
        self._fault("terminated")
        return super()._is_terminated()

    def _fork(self):
        self._fault("fork")
        if self.faulty_forks:  # a fork of a failing grammar fails alike
            return type(self)(self._backend, self._m.fork())
        return super()._fork()


# one request per fault: (rid, prompt, grammar); the grammar decides which hook fails, when
FAULTS = {
    "accept": (Regex(r"[a-z]+( [a-z]+)*!?"), 3),
    "tree": (Regex(r"[a-z]+( [a-z]+)*\??"), 2),
    "row": (Regex(r"[a-z]{1,10}( [a-z]+)*\.?"), 1),  # the model's second word-long run is refused
    "rollback": (Regex(r"[a-z]+( [a-z]+)*,?"), 1),
    "terminated": (Regex(r"[a-z]+( [a-z]+)*;?"), 4),
    "fork": (Regex(r"[a-z]+( [a-z]+)*:?"), 2),
}
# the faults each drafting must reach (a fork only fails in grammar-aware drafting; the n-gram
# drafts mostly follow the model, so only hostile drafts surely meet a refused row in a lazy step
# and roll back a pre-accepted branch)
FIRED = {
    "ngram": {"accept", "terminated", "tree"},
    "hostile-drafts": {"accept", "terminated", "tree", "row", "rollback"},
    "2-threads": {"accept", "terminated", "tree"},
}
FAULTY = tuple((f"fault-{hook}", "Some words:", spec) for hook, (spec, _) in FAULTS.items())
LAZY_FAULTY = tuple(f for f in FAULTY if f[0] != "fault-fork")  # only drafting forks a matcher


class FaultBackend(XGrammarBackend):
    """xgrammar whose matchers of the :data:`FAULTS` grammars fail in their hook while
    ``armed`` (and so do their forks, with ``faulty_forks``); ``fired``: the hooks that raised.
    Disarmed, it is plain xgrammar (one backend for every run: its compile cache is shared)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fired: set[str] = set()
        self.armed = self.faulty_forks = False

    def _matcher(self, compiled):
        m = super()._matcher(compiled)
        for hook, (spec, at) in FAULTS.items():
            if self.armed and compiled.spec == spec:
                attrs = {
                    "hook": hook,
                    "at": at,
                    "fired": self.fired,
                    "faulty_forks": self.faulty_forks,
                }
                return type(f"Fault_{hook}", (FaultMatcher,), attrs)(self, m._m)
        return m


def fault_backend(*, faulty_forks: bool = False) -> FaultBackend:
    """The shared backend armed, its ``fired`` set emptied."""
    backend = xgr_backend()
    backend.fired.clear()
    backend.armed, backend.faulty_forks = True, faulty_forks
    return backend


@pytest.mark.parametrize(
    "options, seed", [("ngram", None), ("hostile-drafts", 3), ("2-threads", None)]
)
def test_grammar_faults_while_lazy_and_fill_alternate_end_only_their_request(options, seed):
    """Five requests whose matchers fail in one hook each (accept, rollback, row fill, tree fill,
    is_terminated) among sound greedy, sampled and plain requests, with lazy / fill,
    thread / inline and early masks alternating (or by coin) every step: the run completes; a
    request whose grammar failed ends with its fault and keeps every token it had committed (a
    prefix of its plain decoding); a faulty request whose hook never ran, and every other
    request, gives exactly its fault-free output."""
    kw = _options(options, xgr_backend())  # (the references are made disarmed)
    plain_reference(), sampled_reference(options)
    backend = fault_backend()
    committed: dict[str, list[int]] = {}

    def on_step(stats, states):
        for st in states:
            if st.finish_reason != "error":
                committed[st.rid] = list(st.output_ids)

    with coin_worker(seed, backend, **kw) as w:
        got = {r.rid: r for r in w.run(requests(extra=LAZY_FAULTY), on_step=on_step)}
        stats = list(w.step_stats)
    ref = plain_reference()
    for rid, _, _ in LAZY_FAULTY:
        r, hook = got[rid], rid.removeprefix("fault-")
        assert r.token_ids[: len(committed.get(rid, []))] == committed.get(rid, []), (
            rid,
            "committed tokens lost",
        )
        if r.finish_reason == "error" and f"injected {hook} fault" in (r.error or ""):
            assert r.token_ids == ref[rid][0][: r.num_tokens], (rid, r.token_ids, ref[rid])
        else:
            assert (r.token_ids, r.finish_reason) == ref[rid], (rid, r.finish_reason, r.error)
    # the faults only a lazy step meets (a refused row's fill, the rollback of a pre-accepted
    # branch) and those only a fill step meets (tree fill) fired: the steps really alternated
    assert FIRED[options] <= backend.fired, backend.fired
    healthy = {
        rid: (r.token_ids, r.finish_reason)
        for rid, r in got.items()
        if not rid.startswith("fault-")
    }
    assert_plain(healthy, options)
    for rid, value in sampled_reference(options).items():
        assert healthy[rid] == value, rid
    assert any(s.lazy_requests for s in stats)


DRAFTING = {
    "forced-tokens": {"forced_tokens": True},  # the default of generate() and the CLI
    "constrained-draft": {"constrain_draft": True, "forced_tokens": True},
    "grammar-draft": {"draft": "grammar", "forced_tokens": True},
}


@pytest.mark.parametrize(
    "drafting, hook",
    [
        ("forced-tokens", "fork"),
        ("forced-tokens", "accept"),
        ("forced-tokens", "terminated"),
        ("constrained-draft", "accept"),
        ("grammar-draft", "terminated"),
    ],
)
def test_a_grammar_failing_inside_grammar_aware_drafting_ends_only_its_request(drafting, hook):
    """Grammar-aware drafting (forced tokens: on by default in ``generate`` and the CLI) forks
    each request's matcher, feeds the fork the pending tokens and walks the draft tree on it. A
    matcher (and its forks) failing there must end its own request (or leave it drafting
    without its grammar), as the same fault in the worker's grammar work does; never the batch.
    (When written: the fault escaped ``SpecWorker.run`` from ``GrammarAwareDrafter.propose``
    (``current_matcher``, ``walk_tree``) and took the whole batch down, every result lost.)"""
    ref = plain_reference()
    backend = fault_backend(faulty_forks=True)
    rid = f"fault-{hook}"
    reqs = requests(sampled=False) + [r for r in requests(extra=FAULTY) if r.rid == rid]
    with coin_worker(None, backend, **DRAFTING[drafting]) as w:
        got = {r.rid: r for r in w.run(reqs)}
    bad = got.pop(rid)
    if bad.finish_reason == "error":
        assert f"injected {hook} fault" in bad.error, bad.error
        assert bad.token_ids == ref[rid][0][: bad.num_tokens]
    else:  # drafted without its grammar, and the worker's own grammar work never met the fault
        assert (bad.token_ids, bad.finish_reason) == ref[rid]
    assert_plain(outcome(got.values()), drafting)


# -- lazy_grammar through the Python API and the CLI --------------------------------------------
BAD_LAZY = ["on", "off", "auto", "", 0, 1, 0.0, 2, [], "True"]


@pytest.mark.parametrize("value", BAD_LAZY, ids=repr)
def test_spec_worker_refuses_a_lazy_grammar_that_is_not_none_or_a_bool(value):
    """``lazy_grammar`` is None / True / False; anything else gets a typed error naming it.
    (When written: anything else was taken as "always lazy", the worker checking ``is False`` /
    ``is None``, so ``lazy_grammar="off"`` or ``0`` turned lazy verification ON every step.)"""
    model, tok = tiny()
    with pytest.raises((TypeError, ValueError), match="lazy_grammar"):
        SpecWorker(model, tok, backend=xgr_backend(), lazy_grammar=value)


@pytest.mark.model
@pytest.mark.parametrize("value", ["off", 0])
def test_generate_and_build_worker_refuse_a_bad_lazy_grammar(value):
    with pytest.raises((TypeError, ValueError), match="lazy_grammar"):
        api.build_worker(lazy_grammar=value, device="cpu")
    with pytest.raises((TypeError, ValueError), match="lazy_grammar"):
        api.generate(
            "Say yes:",
            grammar=Regex("(yes|no)"),
            lazy_grammar=value,
            max_new_tokens=2,
            device="cpu",
            chat=False,
        )


@pytest.mark.parametrize("value", ["maybe", "ON", "true", "1", ""])
def test_cli_refuses_a_bad_lazy_grammar_before_the_model_loads(capsys, monkeypatch, value):
    from spec_grammar.cli import main

    monkeypatch.setattr(
        api, "_load", lambda *a, **k: pytest.fail("the model loaded before the argument error")
    )
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--lazy-grammar", value, "--regex", "a+", "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lazy-grammar" in err and "invalid choice" in err and "auto" in err, err
