"""Many draft trees as one set of flat arrays: the per-request glue of a batched tree fill.

A backend whose library walks one tree per native call (xgrammar's ``traverse_draft_tree``)
still needs, per request, the tree's links as arrays, and afterwards each node's validity and
the zeroing of dead rows (section 3 of the design). Done per request in Python that glue holds
the GIL between the native calls, so fill threads stop scaling past 2-4 (issue 35: 0.50-2.05x at
12 threads on 16 cores). :class:`TreeBatch` builds the links of every tree of a step at once
(one ``numpy`` array for all), and :meth:`TreeBatch.settle` computes every node's validity and
the dead rows of the whole batch in a few vectorized passes (one per tree level), so that what
is left per request is the native call itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import numpy as np

from .tree import DraftTree

__all__ = ["TreeBatch"]


class TreeBatch:
    """The trees of one batched fill, flattened in job order.

    Args:
        trees: the draft trees (parents before children, as :class:`DraftTree` guarantees).
        offsets: each tree's first bitmask row (its node ``k`` is row ``offsets[j] + k``).

    Attributes (``T`` = total nodes, ``J`` = trees):
        links: ``(3, T)`` int64, rows first child / next sibling / token, each tree's links in its
            own node numbering (what a per-tree native walk takes, sliced ``[:, start:stop]``).
        starts: ``(J + 1,)`` int64 prefix sums of the tree sizes.
        parents: ``(T,)`` int64 parent of each node as a flat index (roots: themselves).
        rows: ``(T,)`` int64 bitmask row of each node.
        is_root: ``(T,)`` bool.
    """

    __slots__ = ("links", "starts", "parents", "rows", "is_root", "max_depth")

    def __init__(self, trees: Sequence[DraftTree], offsets: Sequence[int]):
        sizes = [t.num_nodes for t in trees]
        self.starts = np.zeros(len(trees) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        chain = itertools.chain.from_iterable
        self.links = np.array(
            (
                list(chain(t.first_child_list for t in trees)),
                list(chain(t.next_sibling_list for t in trees)),
                list(chain(t.token_list for t in trees)),
            ),
            dtype=np.int64,
        ).reshape(3, -1)
        base = np.repeat(self.starts[:-1], sizes)
        local = np.array(list(chain(t.parent_list for t in trees)), dtype=np.int64)
        self.is_root = local < 0
        self.parents = np.where(self.is_root, np.arange(len(local)), local + base)
        self.rows = np.repeat(np.asarray(offsets, dtype=np.int64) - self.starts[:-1], sizes)
        self.rows += np.arange(len(local))
        # a tree of N nodes is at most N - 1 deep: bounds the level passes of ``settle``
        self.max_depth = max(sizes, default=1) - 1

    @property
    def tokens(self) -> np.ndarray:
        """``(T,)`` int64 token of each node."""
        return self.links[2]

    def settle(
        self, words: np.ndarray, stops: Collection[int], *, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validity and dead rows of every node after a native walk filled the rows of live
        nodes (rows below rejected nodes may be stale: only rows of valid parents are read).

        ``words``: the filled rows, int32, indexed by ``rows`` (default :attr:`rows`, the
        bitmask's own rows; a scratch filled in node order passes ``np.arange(T)``). A node is
        valid when its parent is valid and not a terminating (stop) token and its token's bit is
        set in its parent's row; the root is valid. Returns ``(valid, dead)``, ``(T,)`` bool
        each: dead = invalid, or a non-root node whose token is a stop token (its row is past
        termination). Non-root tokens must lie in ``[0, 32 * words.shape[1])``. Cost: one gather of
        ``T`` words, then one vectorized pass per tree level (nodes come after their parents)."""
        rows = self.rows if rows is None else rows
        parents = self.parents
        stop = np.isin(self.tokens, np.fromiter(stops, dtype=np.int64)) & ~self.is_root
        tokens = np.where(self.is_root, 0, self.tokens)  # a root's token is never read
        bit = (words[rows[parents], tokens >> 5] >> (tokens & 31)) & 1 == 1
        bit &= ~stop[parents]  # nothing follows a terminating token
        bit |= self.is_root
        valid = bit.copy()
        for _ in range(self.max_depth):
            nxt = bit & valid[parents]
            if np.array_equal(nxt, valid):
                break
            valid = nxt
        return valid, ~valid | stop

    def split(self, flags: np.ndarray) -> list[np.ndarray]:
        """``flags`` ``(T,)`` cut into each tree's ``(N,)`` part (views)."""
        return np.split(flags, self.starts[1:-1])
