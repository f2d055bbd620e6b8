"""A step's grammar work: advance every matcher with the committed tokens, then fill the token
bitmask rows of every draft tree (the part of a step that overlaps the verify forward).

Advance-then-fill is forced by the tree semantics: row n is the allowed set after committed +
path root..n, so the matcher must hold every committed token first. The requests of a step are
split into contiguous groups of about equal node count (:func:`split_balanced`), one group per
grammar thread, each advancing and filling its requests into its own rows of the step's host
bitmask (:func:`group_work`); the groups' results are merged in request order
(:meth:`GrammarWork.merge`). A grammar fault ends its request only: it is recorded in
:attr:`GrammarWork.errors`, never raised.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Sequence

import torch

from ..protocol import GrammarBackend
from ..tree import DraftTree
from .batch_verify import pre_accept_first_branch
from .request import RequestState

__all__ = ["Entry", "GrammarWork", "advance", "group_entries", "group_work", "split_balanced"]

Entry = tuple[RequestState, DraftTree | None, int | None]
"""One request of a step's grammar work: ``(state, tree, first bitmask row)``; ``tree`` None for
a finished request that only takes its last tokens, first row None for a request verified
lazily (advanced, then its tree's first branch pre-accepted)."""


class GrammarWork:
    """What the grammar work of one step (or of one group of its requests) hands back."""

    __slots__ = (
        "bitmask",
        "device_bitmask",
        "masked_rows",
        "forbidden_rows",
        "offsets",
        "valid",
        "errors",
        "ms",
        "per_request_ms",
        "pre_accepted",
    )

    def __init__(self, bitmask: torch.Tensor | None = None) -> None:
        self.bitmask = bitmask  # (rows, W) int32 host rows of every filled tree, or None
        self.device_bitmask: torch.Tensor | None = None  # ``bitmask`` on the logits' device
        self.masked_rows: torch.Tensor | None = None  # masked argmax of its rows, queued early
        self.forbidden_rows = 0  # visited rows whose grammar forbade the greedy token
        self.offsets: dict[str, int] = {}  # request id -> first row of its tree in ``bitmask``
        self.valid: dict[str, torch.Tensor] = {}  # request id -> (N,) bool node validity
        self.errors: dict[str, str] = {}  # request id -> why its grammar failed
        self.ms = 0.0  # wall milliseconds of the whole work
        self.per_request_ms: dict[str, float] = {}
        self.pre_accepted: dict[str, list[int]] = {}  # lazy requests: first-branch nodes accepted

    @classmethod
    def merge(cls, parts: Sequence[GrammarWork], bitmask: torch.Tensor | None) -> GrammarWork:
        """The groups' results as one (request ids are distinct across groups)."""
        work = cls(bitmask)
        for part in parts:
            work.offsets.update(part.offsets)
            work.valid.update(part.valid)
            work.errors.update(part.errors)
            work.per_request_ms.update(part.per_request_ms)
            work.pre_accepted.update(part.pre_accepted)
        return work


def split_balanced(weights: Sequence[int], parts: int) -> list[range]:
    """Split ``range(len(weights))`` into ``min(parts, len(weights))`` contiguous, non-empty
    ranges whose weight sums are about equal: boundary k sits where the running sum comes
    closest to ``k / parts`` of the total. Order is kept, so the ranges are also contiguous
    row ranges of a bitmask filled in request order. Returns ``[]`` for no weights."""
    n = len(weights)
    parts = min(parts, n)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    bounds = [0]
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        # leave at least one item for this range and for each range after it
        bounds.append(
            min(range(bounds[-1] + 1, n - parts + k + 1), key=lambda j: abs(prefix[j] - target))
        )
    bounds.append(n)
    return [range(a, b) for a, b in itertools.pairwise(bounds)] if n else []


def group_entries(
    live: Sequence[RequestState],
    trees: Sequence[DraftTree],
    draining: Sequence[RequestState],
    lazy: Collection[str],
    parts: int,
) -> list[list[Entry]]:
    """The step's :data:`Entry` list (draining requests first, then the live grammar requests
    in order, bitmask rows assigned one tree after another) split into at most ``parts``
    groups of about equal work."""
    entries: list[Entry] = [(st, None, 0) for st in draining]
    rows = 0
    for st, tree in zip(live, trees):
        if st.rid in lazy:
            entries.append((st, tree, None))
        elif st.matcher is not None:
            entries.append((st, tree, rows))
            rows += tree.num_nodes
    # a draining request only accepts its last tokens: far cheaper than a tree fill
    groups = split_balanced([1 if t is None else t.num_nodes for _, t, _ in entries], parts)
    return [entries[g.start : g.stop] for g in groups]


def advance(st: RequestState, work: GrammarWork) -> bool:
    """Feed ``st``'s pending committed tokens to its matcher; False (and an error in
    ``work.errors``) if it refuses one or fails."""
    if not st.pending:
        return True
    pending, st.pending = st.pending, []
    try:
        n = st.matcher.accept_tokens(pending)
    except Exception as e:  # a grammar fault ends this request only
        work.errors[st.rid] = (
            f"the grammar failed while accepting committed tokens: {type(e).__name__}: {e}"
        )
        return False
    if n != len(pending):
        work.errors[st.rid] = (
            f"the grammar refused committed token {pending[n]} after {st.matcher.num_accepted} "
            "accepted tokens (a mask/verify mismatch)"
        )
        return False
    return True


def group_work(
    entries: Sequence[Entry],
    bitmask: torch.Tensor | None,
    backend: GrammarBackend,
    drafted_rows: Callable[[RequestState, DraftTree], tuple[torch.Tensor, torch.Tensor] | None],
) -> GrammarWork:
    """Advance + fill of one contiguous group of requests (:data:`Entry` each) into
    ``bitmask`` (``(rows, W)`` int32 host rows). Rows a grammar-aware drafter computed while
    drafting (``drafted_rows``) are copied, not filled; the others are filled by one
    ``backend.fill_tree_bitmasks`` call for the group, and if it raises, each request alone so
    that only the failing one ends."""
    work = GrammarWork(bitmask)
    jobs: list[tuple] = []
    owners: list[RequestState] = []
    for st, tree, off in entries:
        ts = time.perf_counter()
        ok = advance(st, work)
        work.per_request_ms[st.rid] = (time.perf_counter() - ts) * 1e3
        if tree is None or not ok:
            continue
        try:
            terminated = st.matcher.is_terminated()
            if off is None and not terminated:
                work.pre_accepted[st.rid] = pre_accept_first_branch(st.matcher, tree)
                work.per_request_ms[st.rid] = (time.perf_counter() - ts) * 1e3
                continue
            drafted = None if terminated else drafted_rows(st, tree)
        except Exception as e:  # a grammar fault ends this request only
            work.errors[st.rid] = (
                f"the grammar failed while checking its state: {type(e).__name__}: {e}"
            )
            continue
        if terminated:
            work.errors[st.rid] = "the grammar terminated without a stop token being committed"
            continue
        if drafted is not None:
            # rows the grammar-aware drafter computed while drafting are the verification rows
            rows, valid = drafted
            bitmask[off : off + rows.shape[0]] = rows
            work.valid[st.rid] = valid
        else:
            jobs.append((st.matcher, tree, off))
            owners.append(st)
        work.offsets[st.rid] = off
    if jobs:
        _fill_trees(work, jobs, owners, backend)
    return work


def _fill_trees(
    work: GrammarWork, jobs: list[tuple], owners: list[RequestState], backend: GrammarBackend
) -> None:
    """The tree fills of one group (``(matcher, tree, first row)`` per owner), batched; a
    request whose fill fails loses its offset and gets an error."""
    tf = time.perf_counter()
    try:
        valids = backend.fill_tree_bitmasks(jobs, work.bitmask)
    except Exception:  # find the failing request(s): fill each alone
        valids = [_fill_one(st, job, work) for st, job in zip(owners, jobs)]
    fill_ms = (time.perf_counter() - tf) * 1e3
    filled = sum(tree.num_nodes for _, tree, _ in jobs)
    for st, (_, tree, _), valid in zip(owners, jobs, valids):
        if valid is None:
            del work.offsets[st.rid]
            continue
        work.valid[st.rid] = valid
        # a batched fill is timed as a whole: charge it by node count
        work.per_request_ms[st.rid] += fill_ms * tree.num_nodes / filled


def _fill_one(st: RequestState, job: tuple, work: GrammarWork) -> torch.Tensor | None:
    """One request's tree fill; None (and an error for that request) when it raises."""
    matcher, tree, offset = job
    try:
        return matcher.fill_tree_bitmask(tree, work.bitmask, offset)
    except Exception as e:
        work.errors[st.rid] = (
            f"the grammar failed while filling the tree bitmask: {type(e).__name__}: {e}"
        )
        return None
