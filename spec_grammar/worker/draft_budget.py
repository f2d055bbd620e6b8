"""The per-step draft budget: which draft-tree nodes each request verifies this step (none =
plain decoding for that request), chosen to maximise expected committed tokens per second.

A verify forward costs what its rows cost: on a CPU SmolLM2-135M's projections over 16 rows took
1.5-1.6x the time of one row and a 16-node tree's forward 2.2x a token's
(``benchmarks/results/cpu-forward.md``), so a tree per request does not pay where drafts are rarely
accepted (prose, where n-gram matches are rare) and pays a lot where they are (JSON keys and
grammar-forced runs). The policy follows goodput-based speculation control (SmartSpec: Liu et
al., "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput",
arXiv:2406.14066, 2024): choose the speculation that maximises expected accepted tokens over
the predicted step time, both measured online, here per draft-tree node (Sequoia: Chen et al.,
arXiv:2402.12374, 2024, sizes trees from each node's expected acceptance; EAGLE-2: Li et al.,
arXiv:2406.16858, 2024, ranks nodes by path confidence).

- :class:`AcceptModel`: per request the probability ``q`` that the first child of an accepted
  node is accepted (accepted drafts / drafts reached, decayed; shrunk to the batch-wide rate
  while a request has little history). A node's expected value is its path's probability:
  ``gain(child) = gain(parent) * q * (1 - q) ** rank`` (``rank``: its index among its
  siblings; the root's gain is 1).
- :class:`StepCostModel`: milliseconds of the whole step, drafting included, against its
  shape: the verify forward's rows and padded attention rows
  (:meth:`~.runner.ModelRunner.forward_shape`: on CPU the real nodes and the batch padded to
  its largest tree; on GPU the padded CUDA-graph shape for both), the grammar rows its tree
  fills write and the requests the drafter ran for (n-gram lookup, forced-token walks, a draft
  model's forwards), a linear model fitted with exponential forgetting, non-negative.
- :class:`DraftBudget`, before drafting (:meth:`DraftBudget.drafting`): a request whose
  drafts did not pay (accepted drafts per millisecond its drafting cost, the fitted drafting
  term plus what its kept nodes added to the step, below the plain step's tokens per
  millisecond) is not drafted at all: no drafter call, no tree fill, a root-only tree; when no
  request's drafts pay the batch decodes plainly. A new request drafts at once while drafts
  pay batch-wide (the same measure over every request's drafted steps), else it is probed. After drafting
  (:meth:`DraftBudget.choose`): ranks every draft node by gain (a child never outranks its
  parent, so every prefix of the ranking is a set of connected subtrees) and keeps the prefix
  maximising ``(requests + sum of gains) / predicted ms`` of the whole step. The first two
  measured steps (after a cold first one) verify the whole proposal and plain decoding.
  Exploration, so that the cost of larger shapes keeps being measured: at most every
  ``explore_every``-th (16th) step the step verifies a larger prefix of the drafting requests'
  nodes than the best (requests gated off are measured by their probes alone); its predicted
  extra milliseconds are charged, and it runs only while the charges stay within
  ``explore_share`` (2%) of the measured step time. A probe (a request gated off, drafted
  again) is charged the same way: its drafting and what its kept nodes add to the step.
  (Drafting every request on exploring steps, and charging probes their drafting alone, kept
  5-9% more rows per step than plain decoding on prose at batch 8-12 on one and two CPU
  threads, for under 1% more tokens per step.)

Greedy outputs do not depend on the budget: every kept node is verified as before, and a cut
node is one the target would have had to accept to matter. Sampled requests keep their whole
trees (a seeded sample depends on the tree it is verified against, and the budget's choices
depend on measured times).

Both hold up to float rounding. A request's logits can differ in the last bits with the rest of
the batch (the GEMMs pick kernels by row count: up to 1.5e-7 in float32 and 2e-3 in bfloat16
on a small Qwen2-shaped model, 0 in float64, for HF's forward and the fused one alike), and
with the budget on the batch's rows depend on measured times: a greedy near-tie or a seeded
sample drawn at a probability boundary can come out differently from run to run, as between
speculative and plain decoding (``draft_budget=False`` keeps the batch shapes run to run;
in float64 the rows came out the same whatever the batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ..tree import DraftTree

__all__ = ["AcceptModel", "StepCostModel", "DraftBudget", "node_gains"]


class AcceptModel:
    """Online per-request draft acceptance.

    Args:
        decay: weight kept by a request's past counts at each of its steps (its recent
            acceptance counts most).
        prior_weight: pseudo-counts of the batch-wide rate mixed into a request's own (how many
            reached drafts it takes before its own rate dominates).
    """

    def __init__(self, *, decay: float = 0.95, prior_weight: float = 1.0):
        self.decay = decay
        self.prior_weight = prior_weight
        self._own: dict[str, list[float]] = {}  # rid -> [accepted, reached]
        self._all = [1.0, 2.0]  # batch-wide, starts at 0.5

    def rate(self, rid: str) -> float:
        """The probability ``q`` that an accepted node's first child is accepted, in
        ``[0.01, 0.999]``."""
        acc_all, reached_all = self._all
        prior = acc_all / reached_all
        acc, reached = self._own.get(rid, (0.0, 0.0))
        q = (acc + self.prior_weight * prior) / (reached + self.prior_weight)
        return min(max(q, 0.01), 0.999)

    def record(self, rid: str, tree: DraftTree, accepted: Sequence[int]) -> None:
        """One verified step of ``rid``: ``accepted`` are the accepted nodes, root first. A
        depth counts as reached when the accepted node above it had a child in the tree."""
        acc = len(accepted) - 1
        reached = acc + (tree.first_child_list[accepted[-1]] != -1)
        if reached == 0:
            return
        own = self._own.setdefault(rid, [0.0, 0.0])
        own[0] = own[0] * self.decay + acc
        own[1] = own[1] * self.decay + reached
        self._all[0] = self._all[0] * 0.98 + acc
        self._all[1] = self._all[1] * 0.98 + reached

    def forget(self, rid: str) -> None:
        """``rid`` ended."""
        self._own.pop(rid, None)


def node_gains(tree: DraftTree, q: float) -> list[float]:
    """Each node's probability of being accepted under :class:`AcceptModel`'s model (the root
    1.0): ``gain(child) = gain(parent) * q * (1 - q) ** rank``."""
    gain = [1.0] * tree.num_nodes
    rank = [0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        p = tree.parent_list[i]
        sib = tree.next_sibling_list[i]
        if sib != -1:
            rank[sib] = rank[i] + 1
        gain[i] = gain[p] * q * (1.0 - q) ** rank[i]
    return gain


class StepCostModel:
    """Milliseconds of a whole step, from the start of drafting to the end of the step, against
    its shape: a linear model ``ms = a + c * rows + d * padded + g * fill + e * drafted``
    (all coefficients ``>= 0``) fitted by least squares with exponential forgetting, so that it
    follows the host's load.

    - ``rows``: the rows the verify forward's projections compute; ``padded``: the query rows
      its attention runs on (``b * n_max`` where a batch of trees is padded to its largest for
      attention; ``padded == rows`` where the forward computes the padded shape throughout,
      e.g. a CUDA graph). The second term is what made a request's first draft node cost 8-10
      rows' worth on SmolLM2 on a CPU (a batch of 8 single tokens: 97 ms; the same with one
      2-node tree: 108 ms), which a line in rows alone missed.
    - ``fill``: the grammar rows the step's tree fills write (a grammar request's nodes, where
      no drafter handed its rows over); its grammar work competes with the forward for the
      cores when both cores run the forward.
    - ``drafted``: the requests the drafter was called for (n-gram lookup, forced-token walks
      with matcher forks, a draft model's forwards): what a request that drafts nothing saves.

    ``fill`` and ``drafted`` are often collinear with the others (a prose batch fills nothing;
    a batch where every request drafts has ``drafted == b`` on every step): a small ridge on
    their coefficients gives such a cost to the forward's terms, until steps that vary them
    (requests gated off, :class:`DraftBudget`) tell them apart.

    One fit over all steps, not an average per shape: on a shared CPU single steps vary 2-5x,
    and a per-shape average chases its luckiest shapes. A measurement above twice the
    prediction (a step stalled by another process) counts as twice the prediction. The
    coefficients are kept non-negative (the best fit over the subsets of free coefficients
    whose solution is non-negative): a first step slowed by one-time work (345 ms at 12 rows,
    then 100 ms at 5, seen on SmolLM2 on CPU) made a free line cross zero above one row, and
    with the cap every later measurement there counted as twice a near-zero prediction, so the
    line never recovered and drafts were never verified again.

    Args:
        decay: weight kept by the past at each new measurement.
    """

    def __init__(self, *, decay: float = 0.95):
        self.decay = decay
        self._xx = np.zeros((5, 5))  # sum of w * x x^T over x = (1, rows, padded, fill, drafted)
        self._xy = np.zeros(5)  # sum of w * x * ms
        self._yy = 0.0  # sum of w * ms^2
        self._shapes: set[tuple[int, int, int, int]] = set()
        self._coef: np.ndarray | None = None

    @property
    def measured(self) -> int:
        """How many distinct step shapes (rows, padded, fill, drafted) have been measured."""
        return len(self._shapes)

    @property
    def draft_ms(self) -> float:
        """The fitted milliseconds one request's drafting adds to a step (0 before a fit)."""
        return 0.0 if self._coef is None else float(self._coef[4])

    def has(self, rows: int, padded: int | None = None, fill: int = 0, drafted: int = 0) -> bool:
        """Whether a step of this shape (``padded`` default ``rows``) was measured."""
        return (rows, rows if padded is None else padded, fill, drafted) in self._shapes

    def record(
        self, rows: int, ms: float, padded: int | None = None, fill: int = 0, drafted: int = 0
    ) -> None:
        """A step of ``rows`` rows (attention over ``padded`` query rows, default ``rows``;
        ``fill`` grammar rows filled; ``drafted`` requests drafted) took ``ms``. A measurement
        that is no finite non-negative number (NaN, infinity: a broken clock), one whose square
        overflows a float, or a shape with ``padded < rows`` or negative counts is ignored: one
        would poison the fit's sums for good."""
        padded = rows if padded is None else padded
        if rows < 1 or padded < rows or min(fill, drafted) < 0:
            return
        if not (math.isfinite(ms) and ms >= 0):
            return
        pred = self.predict(rows, padded, fill, drafted) if len(self._shapes) > 1 else None
        if pred is not None:
            ms = min(ms, 2.0 * pred)
        x, d = np.array([1.0, rows, padded, fill, drafted]), self.decay
        xx, xy, yy = self._xx * d + np.outer(x, x), self._xy * d + x * ms, self._yy * d + ms * ms
        if not (math.isfinite(yy) and np.isfinite(xx).all() and np.isfinite(xy).all()):
            return  # finite, but its square overflows: as poisonous as an infinity
        self._shapes.add((rows, padded, fill, drafted))
        self._xx, self._xy, self._yy = xx, xy, yy
        self._coef = self._fit() if len(self._shapes) > 1 else None

    def _fit(self) -> np.ndarray:
        """The least-squares coefficients ``(a, c, d, g, e)``, all ``>= 0``: the non-negative
        least-squares fit on the normal equations (Lawson and Hanson's active-set method,
        "Solving Least Squares Problems", 1974, ch. 23; a few 5x5 solves, not one per subset
        of free coefficients). A tiny ridge term keeps collinear shapes (``padded == rows`` on
        every step) solvable, splitting their slope between ``c`` and ``d``; a larger one on
        ``g`` and ``e`` gives a collinear cost to the forward's terms."""
        ridge = np.full(5, 1e-9 * max(float(np.trace(self._xx)), 1.0))
        ridge[3:] += 1e-4 * self._xx[0, 0]
        return _nnls(self._xx + np.diag(ridge), self._xy)

    def predict(
        self, rows: int, padded: int | None = None, fill: int = 0, drafted: int = 0
    ) -> float | None:
        """Predicted milliseconds of a step of this shape (``padded`` default ``rows``); None
        before any measurement. With one shape measured: its time, and proportionally more
        above its rows. Never below 1 us (measured zeros must not make a step look free:
        :class:`DraftBudget` divides by it)."""
        padded = rows if padded is None else padded
        w = self._xx[0, 0]
        if w == 0.0:
            return None
        if self._coef is None:
            mean_ms, mean_rows = self._xy[0] / w, self._xx[0, 1] / w
            return max(mean_ms * max(1.0, rows / mean_rows), 1e-3)
        return max(float(self._coef @ np.array([1.0, rows, padded, fill, drafted])), 1e-3)


Shape = tuple[int, int, int, int]
"""A step's shape for :class:`StepCostModel`: ``(rows, padded, fill, drafted)``."""


class DraftBudget:
    """Decides, every step, which requests draft at all (:meth:`drafting`, before the drafter
    runs) and which of the drafted nodes are verified (:meth:`choose`), to maximise expected
    committed tokens per predicted millisecond of the whole step (module docstring).

    Args:
        explore_every: exploration runs at most every this-many steps: the step verifies a
            larger prefix of the drafted nodes than the best one (at least one more node per
            request, twice the best count of nodes).
        explore_share: exploration runs only while its predicted extra milliseconds (probes'
            drafting and kept nodes, the nodes beyond the best cut) stay within this share of all
            measured step time (one exploring step may overshoot it by its own extra).
        value_decay: weight a request's drafting history keeps at each of its drafted steps.
        max_wait: a request gated off is drafted again (a probe) after 2, 4, .. up to this many
            steps while its drafted steps do not pay, after one step once one does.
    """

    def __init__(
        self,
        *,
        explore_every: int = 16,
        explore_share: float = 0.02,
        value_decay: float = 0.7,
        max_wait: int = 32,
    ):
        self.explore_every = explore_every
        self.explore_share = explore_share
        self.value_decay = value_decay
        self.max_wait = max_wait
        self.accept = AcceptModel()
        self.cost = StepCostModel()
        self._steps = 0
        self._recorded = 0
        self._begun = False  # :meth:`drafting` began this step
        self._exploring = False
        self._last_explore = 0
        self._explore_ms = 0.0  # predicted extra ms charged to exploration
        self._total_ms = 0.0  # measured ms of every recorded step
        self._value: dict[str, list[float]] = {}  # rid -> [accepted drafts, ms], decayed
        self._overall: list[float] | None = None  # the same over every request's drafted steps
        self._probes: set[str] = set()  # gated-off requests drafting this step
        self._margin: dict[str, float] = {}  # rid -> this step's ms for its drafting
        self._wait: dict[str, list[int]] = {}  # rid -> [steps to its next probe, that step]
        self._rate: float | None = None  # this step's plain tokens per ms

    def _begin(self) -> None:
        self._steps += 1
        self._exploring = (
            self._steps - self._last_explore >= self.explore_every
            and self._explore_ms <= self.explore_share * self._total_ms
        )
        if self._exploring:
            self._last_explore = self._steps

    def drafting(
        self,
        rids: Sequence[str],
        shape_of: Callable[[Sequence[int]], int | tuple[int, int]],
        fixed: Sequence[bool] | None = None,
        fill: Sequence[bool] | None = None,
    ) -> list[bool]:
        """Which requests draft this step, before any drafting: those without a drafted step
        yet (while drafts pay batch-wide; else they are probed), the ``fixed`` ones (their
        trees must not depend on timings) and those whose drafts paid: accepted drafts per
        millisecond their drafting cost (the fitted per-request drafting term plus what their
        kept nodes added to the predicted step), decayed over their drafted steps, at least the
        plain step's tokens per millisecond. A request gated
        off drafts again when its probe is due (``max_wait``) and exploration's share allows.
        ``shape_of`` as in :meth:`choose`; ``fill[i]``: request ``i`` has a grammar (its root
        row is filled)."""
        self._begin()
        self._begun = True
        self._probes = set()
        fixed = fixed or [False] * len(rids)
        out = [True] * len(rids)
        if self.cost._coef is None:
            return out
        plain = self.cost.predict(*_shape(shape_of([1] * len(rids)), sum(fill or ()), 0))
        rate = self._rate = len(rids) / plain
        room = self._explore_ms <= self.explore_share * self._total_ms
        new_pays = self._overall is None or _paid(self._overall, rate)
        for i, rid in enumerate(rids):
            v = self._value.get(rid)
            if fixed[i] or (v is None and new_pays) or (v is not None and _paid(v, rate)):
                continue
            # a new request where drafts have not paid lately is probed at once
            due = v is None or self._steps >= self._wait.get(rid, (1, 0))[1]
            out[i] = due and room
            if out[i]:
                self._probes.add(rid)
                self._explore_ms += self.cost.draft_ms
        return out

    def choose(
        self,
        rids: Sequence[str],
        trees: Sequence[DraftTree],
        shape_of: Callable[[Sequence[int]], int | tuple[int, int]],
        fixed: Sequence[bool] | None = None,
        fill: Sequence[bool] | None = None,
        drafted: Sequence[bool] | None = None,
    ) -> list[DraftTree]:
        """This step's trees, each the proposed one or a :meth:`DraftTree.subtree` of it (the
        root always kept). ``shape_of(node_counts)``: the shape of a verify forward over trees
        of these node counts, ``(rows, padded)`` (:meth:`~.runner.ModelRunner.forward_shape`)
        or rows alone (padded = rows). ``fixed[i]``: request ``i`` keeps its whole tree
        (sampled requests: a seeded sample depends on the tree it is verified against, so their
        trees must not depend on timings). ``fill[i]``: request ``i``'s tree rows are filled
        by the step's grammar work (default none); ``drafted[i]``: the drafter ran for request
        ``i`` this step (default all)."""
        if not self._begun:
            self._begin()
        self._begun = False
        n = len(trees)
        fixed = fixed or [False] * n
        fill = fill or [False] * n
        drafted = [True] * n if drafted is None else drafted
        n_drafted = sum(drafted)

        def shape(node_counts: Sequence[int]) -> Shape:
            fills = sum(c for c, f in zip(node_counts, fill) if f)
            return _shape(shape_of(node_counts), fills, n_drafted)

        def predict(node_counts: Sequence[int]) -> float:
            return self.cost.predict(*shape(node_counts))

        counts = [t.num_nodes if f else 1 for t, f in zip(trees, fixed)]
        gain, cands = 0.0, []
        for i, (rid, tree) in enumerate(zip(rids, trees)):
            gains = node_gains(tree, self.accept.rate(rid))
            if fixed[i]:
                gain += sum(gains)
            else:
                gain += 1.0
                cands.extend((-gains[n], i, n) for n in range(1, tree.num_nodes))
        self._margin = {}
        if not cands or self.cost.measured == 0:
            chosen = list(trees)  # nothing to cut, or the first step: measure the whole proposal
        elif self.cost.measured == 1 and self.cost.has(*shape([t.num_nodes for t in trees])):
            cands.sort()
            chosen = self._cut(trees, cands, 0, fixed)  # the second: measure plain decoding
        else:
            cands.sort()
            best_n, best_rate, base = 0, gain / predict(counts), list(counts)
            for k, (neg_gain, i, _) in enumerate(cands, start=1):
                counts[i] += 1
                gain -= neg_gain
                rate = gain / predict(counts)
                if rate > best_rate:
                    best_n, best_rate = k, rate
            n_keep = best_n
            if self._exploring:
                n_keep = min(len(cands), max(2 * best_n, best_n + n))
                self._explore_ms += predict(_counts(base, cands, n_keep)) - predict(
                    _counts(base, cands, best_n)
                )
            chosen = self._cut(trees, cands, n_keep, fixed)
        if self.cost._coef is not None:
            final = [t.num_nodes for t in chosen]
            total = predict(final)
            for i, rid in enumerate(rids):
                if drafted[i] and not fixed[i]:
                    alone = final[:i] + [1] + final[i + 1 :]
                    extra = max(total - predict(alone), 0.0)
                    self._margin[rid] = self.cost.draft_ms + extra
                    if rid in self._probes:  # a probe's nodes are exploration's too
                        self._explore_ms += extra
        return chosen

    @staticmethod
    def _cut(
        trees: Sequence[DraftTree], ranked: list, n: int, fixed: Sequence[bool]
    ) -> list[DraftTree]:
        """``trees`` keeping the root and the first ``n`` nodes of ``ranked`` (all of a
        ``fixed`` tree)."""
        keep: list[list[int]] = [[0] for _ in trees]
        for _, i, node in ranked[:n]:
            keep[i].append(node)
        return [
            t if f or len(k) == t.num_nodes else t.subtree(sorted(k))
            for t, k, f in zip(trees, keep, fixed)
        ]

    def record_accept(self, rid: str, tree: DraftTree, accepted: Sequence[int]) -> None:
        """Request ``rid``'s verified step: ``tree`` (as verified) and its accepted nodes, root
        first (:meth:`AcceptModel.record`); a request that drafted this step also adds its
        accepted drafts and its drafting's milliseconds to its history (:meth:`drafting`)."""
        self.accept.record(rid, tree, accepted)
        ms = self._margin.pop(rid, None)
        if ms is None:
            return
        v = self._value.setdefault(rid, [0.0, 0.0])
        v[0] = v[0] * self.value_decay + len(accepted) - 1
        v[1] = v[1] * self.value_decay + ms
        # per record, not per step: a batch's requests all weigh in within a step or two
        o = self._overall = self._overall or [0.0, 0.0]
        o[0] = o[0] * self.value_decay + len(accepted) - 1
        o[1] = o[1] * self.value_decay + ms
        if self._rate is None or _paid((len(accepted) - 1, ms), self._rate):
            self._wait.pop(rid, None)  # it paid: drafted again next step if gated off
        else:
            wait = self._wait.get(rid, (1, 0))[0]
            wait = min(2 * wait, self.max_wait)
            self._wait[rid] = [wait, self._steps + wait]

    def forget(self, rid: str) -> None:
        """``rid`` ended."""
        self.accept.forget(rid)
        self._value.pop(rid, None)
        self._margin.pop(rid, None)
        self._wait.pop(rid, None)

    def predict(
        self, rows: int, padded: int | None = None, fill: int = 0, drafted: int = 0
    ) -> float | None:
        """The cost model's milliseconds for a step of this shape (:meth:`StepCostModel.predict`);
        None before any step."""
        return self.cost.predict(rows, padded, fill, drafted)

    def record_step(
        self, rows: int, ms: float, padded: int | None = None, fill: int = 0, drafted: int = 0
    ) -> None:
        """The step just verified had this shape (:class:`StepCostModel`) and took ``ms`` from
        the start of drafting. The first step of a worker is left out: it is cold (the math
        library's first calls, first allocations), 1.5x a warm one in a quick-start run, and
        made the line steep."""
        self._recorded += 1
        if self._recorded > 1:
            self.cost.record(rows, ms, padded, fill, drafted)
            if math.isfinite(ms) and ms > 0:
                self._total_ms += ms


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin_{x >= 0} x^T a x - 2 b^T x`` for a symmetric positive definite ``a`` (n, n)
    (Lawson-Hanson's active set: free the coefficient whose gradient points inward most,
    solve on the free set, step back to the boundary while a free one turns negative)."""
    n = len(b)
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-12 * max(float(np.abs(b).max()), 1.0)
    for _ in range(3 * n):
        w = b - a @ x
        w[free] = -np.inf
        j = int(np.argmax(w))
        if w[j] <= tol:
            break
        free[j] = True
        while True:
            z = np.zeros(n)
            idx = np.flatnonzero(free)
            z[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            neg = free & (z <= 0.0)
            if not neg.any():
                x = z
                break
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x


def _paid(value: Sequence[float], rate: float) -> bool:
    """Whether drafting with ``value = (accepted drafts, ms it cost)`` paid at ``rate`` plain
    tokens per ms. Drafts never accepted never pay, whatever they cost: a fitted drafting
    term of 0 ms (the fit is non-negative, and a loaded host's timings can put it there) made
    ``0 >= rate * 0`` hold and kept such requests drafting every step."""
    return value[0] > 0 and value[0] >= rate * value[1]


def _counts(base: Sequence[int], ranked: list, n: int) -> list[int]:
    """Node counts of ``base`` plus the first ``n`` nodes of ``ranked``."""
    out = list(base)
    for _, i, _ in ranked[:n]:
        out[i] += 1
    return out


def _shape(shape: int | tuple[int, int], fill: int = 0, drafted: int = 0) -> Shape:
    """``(rows, padded, fill, drafted)`` of a forward shape given as ``(rows, padded)`` or as
    rows alone."""
    rows, padded = (shape, shape) if isinstance(shape, int) else (int(shape[0]), int(shape[1]))
    return rows, padded, fill, drafted
