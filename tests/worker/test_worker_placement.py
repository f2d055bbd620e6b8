"""The host-work policies of CUDA-graph steps (grammar-work placement, early masking), on
measured-time sequences."""

import pytest

from spec_grammar.worker.placement import EarlyMask, Exploration, GrammarPlacement, LazyGrammar


def test_measures_both_then_picks_the_faster():
    p = GrammarPlacement(explore_every=1000)
    assert p.use_thread(10) is True
    p.record(True, 10, grammar_ms=1.0, launch_ms=0.5)  # 0.1 ms/unit in the thread
    assert p.use_thread(10) is False
    p.record(False, 10, grammar_ms=0.5, launch_ms=0.5)  # 0.05 ms/unit inline
    # small work: max(0.5, 0.1 * 4) < 0.5 + 0.05 * 4 -> thread; large: 0.5 + 5 < 10 -> inline
    assert p.predict(4, True) == pytest.approx(0.5) and p.predict(4, False) == pytest.approx(0.7)
    assert p.use_thread(4) is True
    assert p.use_thread(100) is False


def test_exploration_is_spaced_by_its_predicted_regret():
    e = Exploration(every=4)
    assert [e.due(0.0, 0.0) for _ in range(8)] == [
        False,
        False,
        False,
        True,
    ] * 2  # no regret: every 4th
    assert [e.due(0.1, 0.1) for _ in range(4)] == [
        False,
        False,
        False,
        True,
    ]  # regret <= budget: the same
    # regret 3 budgets: every 12th decision, so tries cost at most budget / every per decision
    assert [i for i in range(1, 37) if e.due(0.3, 0.1)] == [12, 24, 36]
    assert not any(
        e.due(0.3, 0.0) for _ in range(1000)
    )  # no budget: a slower option is never tried
    with pytest.raises(ValueError):
        Exploration(every=1)


def test_explores_the_other_placement_and_follows_the_load():
    p = GrammarPlacement(explore_every=5, explore_share=0.1, alpha=1.0)
    p.record(True, 10, grammar_ms=1.5, launch_ms=0.5)  # thread max(0.5, 1.5) = 1.5 ms
    p.record(False, 10, grammar_ms=0.9, launch_ms=0.5)  # inline 0.5 + 0.9 = 1.4 ms
    choices = [p.use_thread(10) for _ in range(10)]
    assert (
        choices == [False, False, False, False, True] * 2
    )  # regret 0.1 <= 0.14 of budget: every 5th
    p.record(True, 10, grammar_ms=0.2, launch_ms=0.5)  # the thread got fast (alpha 1: replaced)
    assert p.use_thread(10) is True
    p.record(
        True, 10, grammar_ms=10.0, launch_ms=0.5
    )  # the thread got 10 ms slower: tried 20x less often
    assert sum(p.use_thread(10) for _ in range(1000)) == 1000 // (5 * round(8.6 / 0.14 + 0.5))


def test_launch_and_unit_costs_are_moving_averages():
    p = GrammarPlacement(alpha=0.5)
    p.record(False, 4, grammar_ms=4.0, launch_ms=1.0)
    p.record(False, 4, grammar_ms=8.0, launch_ms=3.0)
    assert p.unit_ms[False] == pytest.approx(1.5) and p.launch_ms == pytest.approx(2.0)
    p.record(False, 0, grammar_ms=5.0, launch_ms=2.0)  # no grammar units: only the launch counts
    assert p.unit_ms[False] == pytest.approx(1.5)


@pytest.mark.parametrize("kw", [dict(explore_every=1), dict(alpha=0.0), dict(alpha=1.5)])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        GrammarPlacement(**kw)


def test_early_mask_only_when_greedy_tokens_get_forbidden():
    e = EarlyMask(min_share=0.1, alpha=0.5)
    e.record_forward(5.0)
    assert not e.worth_it(0.1)  # no step has met a forbidden greedy token
    e.record_verify(True)
    assert e.forbidden_share == pytest.approx(0.5) and e.worth_it(0.1)
    for _ in range(3):
        e.record_verify(False)
    assert e.forbidden_share == pytest.approx(0.0625) and not e.worth_it(0.1)


def test_early_mask_only_with_enough_forward_left():
    e = EarlyMask(margin=2.0, alpha=1.0)
    e.record_verify(True)
    assert not e.worth_it(0.1)  # no forward measured yet
    e.record_forward(1.5)
    assert e.worth_it(0.5)  # first early launch: a measurement
    assert not e.worth_it(1.6)  # the forward is (predicted) over
    e.record_launch(0.2)
    assert e.worth_it(1.0)  # 0.5 ms left > 2 x 0.2 ms
    assert not e.worth_it(1.2)  # 0.3 ms left < 0.4 ms


def test_early_mask_averages_and_refuses_bad_times():
    e = EarlyMask(alpha=0.5)
    e.record_forward(2.0)
    e.record_forward(4.0)
    assert e.forward_ms == pytest.approx(3.0)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError):
            e.record_forward(bad)
        with pytest.raises(ValueError):
            e.record_launch(bad)
    assert e.forward_ms == pytest.approx(3.0) and e.launch_ms is None
    for kw in (dict(margin=0.5), dict(alpha=0.0), dict(min_share=1.5)):
        with pytest.raises(ValueError):
            EarlyMask(**kw)


def test_lazy_when_fills_stop_hiding_or_lazy_walks_are_cheap():
    lazy = LazyGrammar(hide=0.75, slack=0.02, explore_every=1000)
    assert not lazy.use_lazy(64, 8, 0.5, None)  # nothing measured: fill first
    lazy.record_fill(64, 3.2)  # 0.05 ms a row
    assert not lazy.use_lazy(64, 8, 0.5, None)  # no forward measured yet
    fwd = 10.0
    assert lazy.use_lazy(64, 8, 0.5, fwd)  # the lazy walk is measured once
    lazy.record_lazy(8, 0.8)  # 0.1 ms a request
    assert not lazy.use_lazy(
        64, 8, 0.5, fwd
    )  # 0.5 + 3.2 <= 7.5: the fill hides; 0.8 > 0.2 of slack
    assert lazy.use_lazy(256, 32, 0.5, fwd)  # 0.5 + 12.8 - 7.5 = 5.8 exposed > 3.2
    assert not lazy.use_lazy(160, 32, 0.5, fwd)  # 1.0 exposed < 3.2
    assert lazy.use_lazy(16, 1, 0.5, fwd)  # 0.1 < 0.2 = 2% of the forward


def test_lazy_explores_the_other_mode_as_its_regret_allows():
    lazy = LazyGrammar(hide=0.75, slack=0.02, explore_every=4)
    lazy.record_fill(10, 1.0)  # fill 0.1 ms a row: 10 rows hide under a 10 ms forward
    lazy.record_lazy(1, 0.21)  # lazy 0.21 ms: fill predicted max(0, 0.2) = 0.2 ms, regret 0.01
    picks = [lazy.use_lazy(10, 1, 0.0, 10.0) for _ in range(8)]
    assert picks == [False, False, False, True] * 2
    # 100 rows expose 10 - 7.5 = 2.5 ms: regret 2.29 ms against a budget of 0.2 ms (2% of the
    # forward), so the fill is tried every 4 * 2.29 / 0.2 = 45.8 -> 46 decisions
    picks = [lazy.use_lazy(100, 1, 0.0, 10.0) for _ in range(100)]
    assert [i + 1 for i, p in enumerate(picks) if not p] == [46, 92]


@pytest.mark.parametrize(
    "kw",
    [
        dict(hide=0.0),
        dict(hide=1.5),
        dict(slack=-0.1),
        dict(slack=1.0),
        dict(explore_every=1),
        dict(alpha=0.0),
    ],
)
def test_lazy_bad_arguments(kw):
    with pytest.raises(ValueError):
        LazyGrammar(**kw)


def test_lazy_refuses_bad_times():
    lazy = LazyGrammar()
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError):
            lazy.record_fill(4, bad)
        with pytest.raises(ValueError):
            lazy.record_lazy(4, bad)
