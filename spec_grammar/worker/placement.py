"""Where and when a CUDA-graph step's host work runs: choices made from the step times measured.

:class:`GrammarPlacement` picks the thread of the grammar work; :class:`EarlyMask` decides
whether the grammar rows are masked on the device while the forward still runs;
:class:`LazyGrammar` decides whether greedy requests skip the tree fill altogether.

With CUDA graphs the forward returns once launched, but launching is not free: the graph
replay takes the host 0.3-1 ms (about 1 us per kernel node) and releases the GIL meanwhile.
The grammar work (advance + tree fill) can then run

* **inline**: on the calling thread after the replay returns; the host's part of the step is
  ``launch + grammar``;
* **in the grammar thread**, started right before the replay; the host's part is
  ``max(launch, grammar')``, where ``grammar'`` is the same work measured from its submission
  until the calling thread runs again after it (both threads' wake-ups included: on a virtual
  machine a thread blocked on the other can take a millisecond to run again).

``grammar'`` is not ``grammar``: on the H200 machine this project measures on (a 16-vCPU
virtual machine) the same grammar work took up to 2x longer in the second thread while the
first one launched (0.21 -> 0.42 ms for one 8-node tree, 18 -> 29 ms for 32 x 64 nodes; 1.0x
in a few configurations), while a bare 2-core host showed 1.05x. So neither placement wins
everywhere: hiding a 0.5 ms launch pays for small grammar work, not for 10 ms of it
(``benchmarks/results/placement/``: 15/23 configurations on target always in the thread,
16/23 always inline, 19/24 with the measured choice). :class:`GrammarPlacement` keeps the
per-unit cost of each placement and the launch time as moving averages, picks the placement
with the smaller predicted host time each step, and tries the other one now and then
(:class:`Exploration`) so that its estimate follows the load. Outputs never depend on it.
"""

from __future__ import annotations

import math

__all__ = ["EarlyMask", "Exploration", "GrammarPlacement", "LazyGrammar"]


class Exploration:
    """When a two-option policy tries the option it does not predict best.

    An option not taken is not measured, so its estimate goes stale when the load changes; it is
    tried now and then. A try costs its *regret*: how much slower that option is predicted to
    be. Tries come at least ``every`` decisions apart, and the further apart the larger the
    regret: a try is due once the decisions since the last one, ``n``, satisfy
    ``n * budget_ms >= every * regret_ms``, so tries cost on average at most
    ``budget_ms / every`` per decision (regret-bounded exploration). On the H200 a fill step
    tried among lazy ones every 50 steps cost 1.5 ms (2.7 -> 4.2 ms steps of a 1.4 ms forward,
    135M at batch 8): 3% of that configuration's tokens/s.

    Args:
        every: the fewest decisions between two tries, an int >= 2.

    Times are milliseconds. Raises ``ValueError`` on bad arguments.
    """

    def __init__(self, every: int = 50):
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise ValueError(f"explore_every must be an int >= 2, got {every!r}")
        self.every = every
        self._since = 0

    def due(self, regret_ms: float, budget_ms: float) -> bool:
        """Count one decision; True: this one tries the option not predicted best.
        ``regret_ms``: its predicted extra cost (>= 0); ``budget_ms``: what a try may cost,
        amortized over ``every`` decisions (0: never try an option predicted slower)."""
        self._since += 1
        # NaN (inf - inf: both predictions overflowed) or a negative value counts as 0, so that
        # options predicted equal are still tried every ``every`` decisions (n * nan >= 0 never is)
        regret_ms = regret_ms if regret_ms > 0 else 0.0
        budget_ms = budget_ms if budget_ms > 0 else 0.0
        if self._since >= self.every and self._since * budget_ms >= self.every * regret_ms:
            self._since = 0
            return True
        return False


class GrammarPlacement:
    """Online choice between inline and threaded grammar work for CUDA-graph steps.

    Args:
        explore_every: the placement not predicted best runs once at least every this many
            decisions, less often the slower it is predicted (:class:`Exploration`, a try
            costing on average at most ``explore_share`` of the predicted host time per
            ``explore_every`` decisions).
        explore_share: as above, in ``[0, 1]``.
        alpha: weight of a new measurement in the moving averages, in ``(0, 1]``.

    Work is counted in *units* (the caller's measure of a step's grammar work, e.g. tree rows
    plus requests); times are milliseconds. Raises ``ValueError`` on bad arguments.
    """

    def __init__(self, *, explore_every: int = 50, explore_share: float = 0.1, alpha: float = 0.2):
        if not 0.0 <= _number("explore_share", explore_share) <= 1.0:
            raise ValueError(f"explore_share must be in [0, 1], got {explore_share}")
        if not 0.0 < _number("alpha", alpha) <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._explore = Exploration(explore_every)
        self.explore_share = explore_share
        self.alpha = alpha
        self.launch_ms: float | None = None
        self.unit_ms: dict[bool, float | None] = {True: None, False: None}  # key: in the thread

    def use_thread(self, units: int) -> bool:
        """True: run this step's grammar work in the grammar thread (started before the
        replay); False: inline after it. Each placement runs first once to be measured."""
        for thread in (True, False):
            if self.unit_ms[thread] is None:
                return thread
        thread_ms, inline_ms = self.predict(units, True), self.predict(units, False)
        best = thread_ms < inline_ms
        due = self._explore.due(
            abs(thread_ms - inline_ms), self.explore_share * min(thread_ms, inline_ms)
        )
        return (not best) if due else best

    def predict(self, units: int, thread: bool) -> float:
        """Predicted host milliseconds of launch + grammar work for ``units`` of work."""
        launch = self.launch_ms or 0.0
        grammar = (self.unit_ms[thread] or 0.0) * units
        return max(launch, grammar) if thread else launch + grammar

    def record(self, thread: bool, units: int, grammar_ms: float, launch_ms: float) -> None:
        """A step's measurements: the grammar work's milliseconds (in the thread: from its
        submission until the caller runs again after its end) and the replay's host
        milliseconds. Raises ``ValueError`` on a time that is not a finite number >= 0 (it would
        stay in the averages for good)."""
        _checked("grammar_ms", grammar_ms)
        self.launch_ms = _ema(self.launch_ms, _checked("launch_ms", launch_ms), self.alpha)
        if units > 0:
            self.unit_ms[thread] = _ema(self.unit_ms[thread], grammar_ms / units, self.alpha)


class EarlyMask:
    """Whether to mask a step's grammar rows on the device while its forward still runs.

    Greedy verification reads each row's unmasked greedy token from the forward and masks on
    the device only the rows its walks visit whose grammar forbids that token: one extra round
    trip in the steps that have such rows (about a quarter of the steps of SmolLM2-135M writing
    JSON; none when the model agrees with its grammar). When such steps are common and the host
    finishes the grammar work well before the GPU finishes the forward, the bitmask upload and a
    masked argmax over every grammar row can be queued right away instead: its host time is
    hidden and no step needs the round trip, for the GPU time of one pass over the step's logits.
    This asks for both: the share of steps with forbidden greedy tokens at least ``min_share``,
    and the forward's remaining GPU time (predicted from the previous forwards) at least
    ``margin`` times the launch's host time; all three are moving averages.

    Args:
        margin: launch early only when the remaining GPU time exceeds ``margin`` times the
            launch's host time.
        min_share: the share of steps with a forbidden greedy token needed to launch early.
        alpha: weight of a new measurement in the moving averages, in ``(0, 1]``.

    Times are milliseconds. Raises ``ValueError`` on bad arguments or measurements.
    """

    def __init__(self, *, margin: float = 2.0, min_share: float = 0.05, alpha: float = 0.2):
        if not _number("margin", margin) >= 1.0:
            raise ValueError(f"margin must be >= 1, got {margin}")
        if not 0.0 <= _number("min_share", min_share) <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share}")
        if not 0.0 < _number("alpha", alpha) <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.margin, self.min_share, self.alpha = margin, min_share, alpha
        self.forward_ms: float | None = None  # GPU time of a forward
        self.launch_ms: float | None = None  # host time of the early upload + masked argmax
        self.forbidden_share = 0.0  # share of steps whose walks met a forbidden greedy token

    def worth_it(self, since_launch_ms: float) -> bool:
        """True: queue the early mask now, ``since_launch_ms`` after the forward was launched.
        False until a forward's GPU time is known; the first early launch is a measurement."""
        if self.forward_ms is None or self.forbidden_share < self.min_share:
            return False
        remaining = self.forward_ms - since_launch_ms
        return remaining > (self.margin * self.launch_ms if self.launch_ms is not None else 0.0)

    def record_forward(self, gpu_ms: float) -> None:
        """A forward's GPU milliseconds (CUDA events around its replay)."""
        self.forward_ms = _ema(self.forward_ms, _checked("gpu_ms", gpu_ms), self.alpha)

    def record_launch(self, host_ms: float) -> None:
        """The host milliseconds an early mask took to queue."""
        self.launch_ms = _ema(self.launch_ms, _checked("host_ms", host_ms), self.alpha)

    def record_verify(self, forbidden: bool) -> None:
        """Whether a step's walks met a row whose grammar forbids its greedy token. Raises
        ``ValueError`` unless ``forbidden`` is a bool."""
        if not isinstance(forbidden, bool):
            raise ValueError(f"forbidden must be a bool, got {forbidden!r}")
        self.forbidden_share += self.alpha * (float(forbidden) - self.forbidden_share)


class LazyGrammar:
    """Whether a step verifies its greedy grammar requests *lazily*: no tree fill under the
    forward; after it, each greedy walk asks the request's matcher to accept the greedy token of
    each row it reaches, and fills only a row whose greedy token the grammar refuses
    (:class:`~spec_grammar.worker.batch_verify._LazyWalk`).

    A tree fill costs one full-vocabulary mask per node (7-25 us a row with xgrammar, more with
    a 262k vocabulary), for every node of every tree, whether the walk reads the row or not; a
    lazy walk costs about one token accept (~1-3 us) per committed token, plus a single-row fill
    where the model wants a token its grammar forbids. The fill is free while it hides under the
    forward; the lazy walk never hides (it needs the forward's tokens), but the worker
    pre-accepts each tree's first branch under the forward, so the walk is mostly one rollback
    and one accept per request. The fill counts as exposed by ``launch + fill - hide *
    forward`` (the predicted fill plus the launch's host time beyond ``hide`` times the
    forward's GPU time), the lazy walks by their measured milliseconds per request; lazy wins
    when it exposes less, or costs under ``slack`` times the forward: a fill step has host
    work after the forward too (one bitmask word per visited row, node validity) that its
    prediction leaves out, of that order (on the H200, 8B at batch 1 ran fill steps 0.1-0.2 ms
    slower than plain ones with the whole fill hidden). Each mode runs first once to be
    measured (the fill first); then the other mode is tried now and then so that its estimate
    follows the load (:class:`Exploration`: at least ``explore_every`` decisions apart, a try
    costing on average at most ``slack`` times the forward per ``explore_every`` decisions).
    Outputs never depend on it.

    Args:
        hide: the share of the forward's GPU time a fill may take and still count as hidden
            (grammar time varies step to step: at 77-94% of the forward, the H200 runs exposed
            some of it), in ``(0, 1]``.
        slack: lazy walks costing less than this share of the forward's GPU time are taken
            even when the fill would hide, in ``[0, 1)``; also the exploration's budget.
        explore_every, alpha: as in :class:`GrammarPlacement`.

    Times are milliseconds. Raises ``ValueError`` on bad arguments or measurements.
    """

    def __init__(
        self,
        *,
        hide: float = 0.75,
        slack: float = 0.02,
        explore_every: int = 50,
        alpha: float = 0.2,
    ):
        if not 0.0 < _number("hide", hide) <= 1.0:
            raise ValueError(f"hide must be in (0, 1], got {hide}")
        if not 0.0 <= _number("slack", slack) < 1.0:
            raise ValueError(f"slack must be in [0, 1), got {slack}")
        if not 0.0 < _number("alpha", alpha) <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._explore = Exploration(explore_every)
        self.hide, self.slack, self.alpha = hide, slack, alpha
        self.row_ms: float | None = None  # grammar work of a fill step, per tree row
        self.request_ms: float | None = None  # lazy walk of one request

    def use_lazy(
        self, rows: int, requests: int, launch_ms: float | None, forward_ms: float | None
    ) -> bool:
        """True: verify this step's ``requests`` greedy grammar requests (``rows`` tree rows in
        all) lazily; False: fill their trees under the forward. ``launch_ms``: the replay's
        host time (:attr:`GrammarPlacement.launch_ms`); ``forward_ms``: a forward's GPU time
        (:attr:`EarlyMask.forward_ms`); None while not measured."""
        if forward_ms is None or self.row_ms is None:
            return False
        if self.request_ms is None:
            return True  # the lazy walk's cost is measured once
        fill_ms = max(
            0.0,
            (launch_ms or 0.0) + self.row_ms * rows - self.hide * forward_ms,
            self.slack * forward_ms,
        )
        lazy_ms = self.request_ms * requests
        due = self._explore.due(abs(fill_ms - lazy_ms), self.slack * forward_ms)
        return (lazy_ms >= fill_ms) if due else (lazy_ms < fill_ms)

    def record_fill(self, rows: int, grammar_ms: float) -> None:
        """A fill step's grammar work (advance + tree fill) over ``rows`` tree rows."""
        _checked("grammar_ms", grammar_ms)
        if rows > 0:
            self.row_ms = _ema(self.row_ms, grammar_ms / rows, self.alpha)

    def record_lazy(self, requests: int, grammar_ms: float) -> None:
        """A lazy step's walks: ``grammar_ms`` in all over ``requests`` requests."""
        _checked("grammar_ms", grammar_ms)
        if requests > 0:
            self.request_ms = _ema(self.request_ms, grammar_ms / requests, self.alpha)


def _number(name: str, value: object) -> float:
    """``value`` when it is a real number (not a bool); else ``ValueError`` naming ``name``
    (a string compared with a bound raised a TypeError that named nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r:.40}")
    return value


def _checked(name: str, ms: float) -> float:
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {ms}")
    return ms


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)
