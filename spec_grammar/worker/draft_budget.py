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
- :class:`StepCostModel`: milliseconds from the end of drafting to the end of the step (verify
  forward, grammar work not hidden, acceptance) against the forward's shape
  (:meth:`~.runner.ModelRunner.forward_shape`: the rows its projections compute, the real nodes
  on CPU, and the query rows attention runs on, the batch padded to its largest tree; both the
  padded CUDA-graph shape on GPU): a plane fitted with exponential forgetting.
- :class:`DraftBudget`: ranks every draft node of the step by gain (a child never outranks its
  parent, so every prefix of the ranking is a set of connected subtrees) and keeps the prefix
  maximising ``(requests + sum of gains) / predicted ms``. The first two measured steps (after
  a cold first one) verify the whole proposal and plain decoding; every
  ``explore_every``-th step verifies a larger prefix than the best, so the cost model keeps
  learning the counts just above its choice.

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
    """Step milliseconds after drafting against the shape of the verify forward: a plane
    ``ms = a + c * rows + d * padded`` (``a, c, d >= 0``) fitted by least squares with
    exponential forgetting, so that it follows the host's load. ``rows`` are the rows the
    projections compute, ``padded`` the query rows attention runs on (``b * n_max`` where a
    batch of trees is padded to its largest for attention; ``padded == rows`` where the
    forward computes the padded shape throughout, e.g. a CUDA graph). The second term is what
    made a request's first draft node cost 8-10 rows' worth on SmolLM2 on a CPU (a batch of 8
    single tokens: 97 ms; the same with one 2-node tree: 108 ms; attention over the padded
    batch and the padding bookkeeping), which a line in rows alone missed, so the budget kept
    drafts on prose that did not pay.

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
        self._xx = np.zeros((3, 3))  # sum of w * x x^T over x = (1, rows, padded)
        self._xy = np.zeros(3)  # sum of w * x * ms
        self._yy = 0.0  # sum of w * ms^2
        self._shapes: set[tuple[int, int]] = set()
        self._coef: np.ndarray | None = None

    @property
    def measured(self) -> int:
        """How many distinct forward shapes (rows, padded) have been measured."""
        return len(self._shapes)

    def has(self, rows: int, padded: int | None = None) -> bool:
        """Whether a forward of ``rows`` rows (``padded`` query rows; default ``rows``) was
        measured."""
        return (rows, rows if padded is None else padded) in self._shapes

    def record(self, rows: int, ms: float, padded: int | None = None) -> None:
        """A step of ``rows`` rows (attention over ``padded`` query rows; default ``rows``)
        took ``ms`` after drafting. A measurement that is no finite non-negative number (NaN,
        infinity: a broken clock), one whose square overflows a float, or a shape with
        ``padded < rows`` is ignored: one would poison the fit's sums for good."""
        padded = rows if padded is None else padded
        if rows < 1 or padded < rows or not (math.isfinite(ms) and ms >= 0):
            return
        pred = self.predict(rows, padded) if len(self._shapes) > 1 else None
        if pred is not None:
            ms = min(ms, 2.0 * pred)
        x, d = np.array([1.0, rows, padded]), self.decay
        xx, xy, yy = self._xx * d + np.outer(x, x), self._xy * d + x * ms, self._yy * d + ms * ms
        if not (math.isfinite(yy) and np.isfinite(xx).all() and np.isfinite(xy).all()):
            return  # finite, but its square overflows: as poisonous as an infinity
        self._shapes.add((rows, padded))
        self._xx, self._xy, self._yy = xx, xy, yy
        self._coef = self._fit() if len(self._shapes) > 1 else None

    def _fit(self) -> np.ndarray | None:
        """The least-squares coefficients ``(a, c, d)``, all ``>= 0``: the lowest residual among
        the fits over each subset of free coefficients (the others 0) whose solution is
        non-negative. A tiny ridge term keeps collinear shapes (``padded == rows`` on every
        step) solvable; it splits their slope between ``c`` and ``d``."""
        ridge = 1e-9 * max(float(np.trace(self._xx)), 1.0)
        best, best_sse = None, math.inf
        for free in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            idx = list(free)
            a = self._xx[np.ix_(idx, idx)] + ridge * np.eye(len(idx))
            try:
                sol = np.linalg.solve(a, self._xy[idx])
            except np.linalg.LinAlgError:
                continue
            if (sol < 0.0).any():
                continue
            coef = np.zeros(3)
            coef[idx] = sol
            sse = self._yy - 2.0 * coef @ self._xy + coef @ self._xx @ coef
            if sse < best_sse - 1e-12 * max(self._yy, 1.0):
                best, best_sse = coef, sse
        return best

    def predict(self, rows: int, padded: int | None = None) -> float | None:
        """Predicted milliseconds of a step over ``rows`` rows (``padded`` query rows; default
        ``rows``); None before any measurement. With one shape measured: its time, and
        proportionally more above its rows. Never below 1 us (measured zeros must not make a
        step look free: :class:`DraftBudget` divides by it)."""
        padded = rows if padded is None else padded
        w = self._xx[0, 0]
        if w == 0.0:
            return None
        if self._coef is None:
            mean_ms, mean_rows = self._xy[0] / w, self._xx[0, 1] / w
            return max(mean_ms * max(1.0, rows / mean_rows), 1e-3)
        return max(float(self._coef @ np.array([1.0, rows, padded])), 1e-3)


class DraftBudget:
    """Cuts each step's draft trees to the nodes that maximise expected committed tokens per
    predicted millisecond (module docstring).

    Args:
        explore_every: every this-many steps verify a larger prefix than the best one (at least
            one more node per request, twice the best count of nodes).
    """

    def __init__(self, *, explore_every: int = 16):
        self.explore_every = explore_every
        self.accept = AcceptModel()
        self.cost = StepCostModel()
        self._steps = 0
        self._recorded = 0

    def choose(
        self,
        rids: Sequence[str],
        trees: Sequence[DraftTree],
        shape_of: Callable[[Sequence[int]], int | tuple[int, int]],
        fixed: Sequence[bool] | None = None,
    ) -> list[DraftTree]:
        """This step's trees, each the proposed one or a :meth:`DraftTree.subtree` of it (the
        root always kept). ``shape_of(node_counts)``: the shape of a verify forward over trees
        of these node counts, ``(rows, padded)`` (:meth:`~.runner.ModelRunner.forward_shape`)
        or rows alone (padded = rows). ``fixed[i]``: request ``i`` keeps its whole tree
        (sampled requests: a seeded sample depends on the tree it is verified against, so their
        trees must not depend on timings)."""

        def predict(node_counts: Sequence[int]) -> float:
            return self.cost.predict(*_shape(shape_of(node_counts)))

        self._steps += 1
        fixed = fixed or [False] * len(trees)
        counts = [t.num_nodes if f else 1 for t, f in zip(trees, fixed)]
        gain, cands = 0.0, []
        for i, (rid, tree) in enumerate(zip(rids, trees)):
            gains = node_gains(tree, self.accept.rate(rid))
            if fixed[i]:
                gain += sum(gains)
            else:
                gain += 1.0
                cands.extend((-gains[n], i, n) for n in range(1, tree.num_nodes))
        if not cands or self.cost.measured == 0:
            return list(trees)  # nothing to cut, or the first step: measure the whole proposal
        cands.sort()
        if self.cost.measured == 1 and self.cost.has(
            *_shape(shape_of([t.num_nodes for t in trees]))
        ):
            return self._cut(trees, cands, 0, fixed)  # the second: measure plain decoding
        best_n, best_rate = 0, gain / predict(counts)
        for n, (neg_gain, i, _) in enumerate(cands, start=1):
            counts[i] += 1
            gain -= neg_gain
            rate = gain / predict(counts)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if self._steps % self.explore_every == 0:
            best_n = min(len(cands), max(2 * best_n, best_n + len(trees)))
        return self._cut(trees, cands, best_n, fixed)

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

    def predict(self, rows: int, padded: int | None = None) -> float | None:
        """The cost model's milliseconds for a step of ``rows`` rows, attention over ``padded``
        query rows (default ``rows``); None before any step."""
        return self.cost.predict(rows, padded)

    def record_step(self, rows: int, ms: float, padded: int | None = None) -> None:
        """The step just verified computed ``rows`` rows (attention over ``padded``, default
        ``rows``) and took ``ms`` after drafting. The first step of a worker is left out: it is
        cold (the math library's first calls, first allocations), 1.5x a warm one in a
        quick-start run, and made the line steep."""
        self._recorded += 1
        if self._recorded > 1:
            self.cost.record(rows, ms, padded)


def _shape(shape: int | tuple[int, int]) -> tuple[int, int]:
    """``(rows, padded)`` of a forward shape given as both or as rows alone."""
    return (shape, shape) if isinstance(shape, int) else (int(shape[0]), int(shape[1]))
