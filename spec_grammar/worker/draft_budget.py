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
  forward, grammar work not hidden, acceptance) against the rows the forward computes
  (:meth:`~.runner.ModelRunner.forward_rows`: the real nodes on CPU, the padded CUDA-graph
  shape on GPU): a line fitted with exponential forgetting.
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
    """Step milliseconds after drafting against the rows of the verify forward: a straight line
    ``ms = a + c * rows`` (``a, c >= 0``) fitted by least squares with exponential forgetting,
    so that it follows the host's load. One line over all steps, not an average per row count:
    on a shared CPU single steps vary 2-5x, and a per-count average chases its luckiest counts.
    A measurement above twice the prediction (a step stalled by another process) counts as
    twice the prediction. The intercept is kept non-negative: a first step slowed by one-time
    work (345 ms at 12 rows, then 100 ms at 5, seen on SmolLM2 on CPU) made a free line cross
    zero above one row, and with the cap every later measurement there counted as twice a
    near-zero prediction, so the line never recovered and drafts were never verified again.

    Args:
        decay: weight kept by the past at each new measurement.
    """

    def __init__(self, *, decay: float = 0.95):
        self.decay = decay
        self._sums = [0.0] * 5  # sum of w, w*x, w*x^2, w*y, w*x*y
        self._counts: set[int] = set()

    @property
    def measured(self) -> int:
        """How many distinct row counts have been measured."""
        return len(self._counts)

    def has(self, rows: int) -> bool:
        """Whether ``rows`` rows were measured."""
        return rows in self._counts

    def record(self, rows: int, ms: float) -> None:
        """A step of ``rows`` rows took ``ms`` after drafting. A measurement that is no finite
        non-negative number (NaN, infinity: a broken clock) is ignored: one would poison the
        fit's sums for good."""
        if rows < 1 or not (math.isfinite(ms) and ms >= 0):
            return
        pred = self.predict(rows) if len(self._counts) > 1 else None
        if pred is not None:
            ms = min(ms, 2.0 * pred)
        self._counts.add(rows)
        x, d = float(rows), self.decay
        for k, v in enumerate((1.0, x, x * x, ms, x * ms)):
            self._sums[k] = self._sums[k] * d + v

    def predict(self, rows: int) -> float | None:
        """Predicted milliseconds of a step over ``rows`` rows; None before any measurement.
        With one row count measured: its time, and proportionally more above it. Never below
        1 us (measured zeros must not make a step look free: :class:`DraftBudget` divides by
        it)."""
        w, sx, sxx, sy, sxy = self._sums
        if w == 0.0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if len(self._counts) < 2 or var <= 1e-9 * max(mx * mx, 1.0):
            return max(my * max(1.0, rows / mx), 1e-3)
        slope = max((sxy / w - mx * my) / var, 0.0)
        if my - slope * mx < 0.0:  # the fit with a >= 0: its optimum lies on a = 0
            return max(sxy / sxx * rows, 1e-3)
        return max(my + slope * (rows - mx), 1e-3)


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
        rows_of: Callable[[Sequence[int]], int],
        fixed: Sequence[bool] | None = None,
    ) -> list[DraftTree]:
        """This step's trees, each the proposed one or a :meth:`DraftTree.subtree` of it (the
        root always kept). ``rows_of(node_counts)``: the rows a verify forward over trees of
        these node counts computes. ``fixed[i]``: request ``i`` keeps its whole tree (sampled
        requests: a seeded sample depends on the tree it is verified against, so their trees
        must not depend on timings)."""
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
        if self.cost.measured == 1 and self.cost.has(rows_of([t.num_nodes for t in trees])):
            return self._cut(trees, cands, 0, fixed)  # the second: measure plain decoding
        best_n, best_rate = 0, gain / self.cost.predict(rows_of(counts))
        for n, (neg_gain, i, _) in enumerate(cands, start=1):
            counts[i] += 1
            gain -= neg_gain
            rate = gain / self.cost.predict(rows_of(counts))
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

    def predict(self, rows: int) -> float | None:
        """The cost model's milliseconds for a step of ``rows`` rows (None before any step)."""
        return self.cost.predict(rows)

    def record_step(self, rows: int, ms: float) -> None:
        """The step just verified computed ``rows`` rows and took ``ms`` after drafting. The
        first step of a worker is left out: it is cold (the math library's first calls, first
        allocations), 1.5x a warm one in a quick-start run, and made the line steep."""
        self._recorded += 1
        if self._recorded > 1:
            self.cost.record(rows, ms)
