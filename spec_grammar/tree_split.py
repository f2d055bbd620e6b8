"""One draft tree's walk cut into pieces that fill threads can run side by side.

A batched tree fill spreads whole trees over threads, so a step takes at least as long as its
slowest tree. One request's tree can be most of a step: at batch 128 with 64-node trees on
Gemma-3's 262k vocabulary, one JSONSchemaBench request inside a string with a Unicode ``\\w``
pattern filled its 64 rows in 66 ms of a step's 149 ms (issue 35). Its rows are independent
once each node's grammar state is known, and a node's state is the root's state advanced by the
tokens on its path, so the tree can be cut into pieces, each walked by its own copy of the
matcher moved along the path to the piece's anchor.

:func:`split_tree` cuts a tree into pieces of at most ``max_rows`` nodes (greedy, bottom-up: a
subtree becomes a piece once it holds ``max_rows`` nodes; the children of a piece's root that
are left over are grouped into pieces anchored at that root, which walk its row again and
discard it). :func:`piece_sizes` decides which trees of a batch to cut, and how finely, from
each tree's measured cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .tree import DraftTree

__all__ = ["TreePiece", "piece_sizes", "split_tree"]


@dataclass(frozen=True)
class TreePiece:
    """A part of a draft tree walked on its own.

    Attributes:
        anchor: the tree node whose grammar state the piece's walk starts from (local node 0).
        path: tokens from the tree's root to ``anchor`` (the root's own token left out,
            ``anchor``'s included; empty when ``anchor`` is the root): what a copy of the root's
            matcher accepts before the walk.
        nodes: ``(k,)`` int64 tree nodes of the walk in local order, ``nodes[0] == anchor``;
            parents before children.
        links: ``(3, k)`` int64 local first child / next sibling / token rows of the walk
            (``-1``: none), what xgrammar's ``traverse_draft_tree`` takes.
        owns_anchor: whether the anchor's row is this piece's to write (exactly one piece
            of a tree owns each node; a piece that does not own its anchor walks the anchor's
            row only to reach its children).
    """

    anchor: int
    path: tuple[int, ...]
    nodes: np.ndarray
    links: np.ndarray
    owns_anchor: bool

    @property
    def rows(self) -> np.ndarray:
        """``(r,)`` int64 tree nodes whose rows this piece writes."""
        return self.nodes if self.owns_anchor else self.nodes[1:]


def _piece(
    tree: DraftTree, anchor: int, members: list[int], owns: bool, path: tuple[int, ...]
) -> TreePiece:
    """The piece walking ``anchor`` then ``members`` (the anchor's kept descendants, any
    order), with local links."""
    nodes = np.array(sorted(members), dtype=np.int64)
    nodes = np.concatenate(([anchor], nodes))
    local = {int(v): i for i, v in enumerate(nodes)}
    k = len(nodes)
    first = [-1] * k
    sibling = [-1] * k
    last = [-1] * k
    parents = tree.parent_list
    for i in range(1, k):  # ascending node order: siblings in increasing index, as the tree's
        p = local[parents[int(nodes[i])]]
        if first[p] < 0:
            first[p] = i
        else:
            sibling[last[p]] = i
        last[p] = i
    tokens = np.asarray(tree.token_list, dtype=np.int64)[nodes]
    links = np.array((first, sibling, tokens), dtype=np.int64)
    return TreePiece(anchor, path, nodes, links, owns)


def split_tree(
    tree: DraftTree, max_rows: int, cuttable: np.ndarray | None = None
) -> list[TreePiece]:
    """Cut ``tree`` into pieces whose rows partition its nodes, each of at most ``max_rows``
    rows (one more walked where a piece does not own its anchor).

    Args:
        tree: the draft tree (parents before children).
        max_rows: the most rows a piece writes (>= 1).
        cuttable: ``(N,)`` bool, the nodes a piece may be anchored at below the root (None:
            all). A caller leaves out nodes whose state a matcher cannot be moved to alone, such
            as those at or below a stop token; nodes under a non-cuttable node stay with it, so
            a piece may then hold more than ``max_rows`` rows.

    Returns the pieces, the one owning the root first; one piece (the whole tree) when the tree
    has at most ``max_rows`` nodes. Raises ValueError when ``max_rows < 1``.

    Greedy bottom-up: nodes are visited from the last to the first, each subtree's count of rows
    not yet in a piece is added to its parent, and a subtree reaching ``max_rows`` becomes a
    piece; then the leftover children of each piece's root are packed in order into groups of
    at most ``max_rows`` rows, the first group with the root itself.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    n = tree.num_nodes
    parents, tokens = tree.parent_list, tree.token_list
    if n <= max_rows:
        return [_piece(tree, 0, list(range(1, n)), True, ())]
    pending = [1] * n  # rows of each subtree not yet in a piece
    kids: list[list[int]] = [[] for _ in range(n)]  # children whose subtree is still pending
    cut = [False] * n
    for v in range(n - 1, 0, -1):
        if pending[v] >= max_rows and (cuttable is None or cuttable[v]):
            cut[v] = True
        else:
            pending[parents[v]] += pending[v]
            kids[parents[v]].append(v)

    def members(v: int) -> list[int]:
        """``v``'s pending descendants (``v`` left out)."""
        out, stack = [], list(kids[v])
        while stack:
            u = stack.pop()
            out.append(u)
            stack.extend(kids[u])
        return out

    def path(v: int) -> tuple[int, ...]:
        toks = []
        while v > 0:
            toks.append(tokens[v])
            v = parents[v]
        return tuple(reversed(toks))

    pieces = []
    for root in [0] + [v for v in range(1, n) if cut[v]]:
        to = path(root)
        group: list[int] = []
        size, owns = 1, True  # the first group writes the root's row
        for c in reversed(kids[root]):  # kids were appended last-first
            sub = [c, *members(c)]
            if group and size + len(sub) > max_rows:
                pieces.append(_piece(tree, root, group, owns, to))
                group, size, owns = [], 0, False
            group.extend(sub)
            size += len(sub)
        if group or owns:
            pieces.append(_piece(tree, root, group, owns, to))
    return pieces


def piece_sizes(costs: list[float | None], sizes: list[int], threads: int) -> list[int]:
    """How finely to cut each tree of a batch filled by ``threads`` threads.

    Args:
        costs: each tree's expected fill time (any unit; its rows' cost measured in an earlier
            fill times its node count), None where unknown (such a tree is never cut).
        sizes: each tree's node count.
        threads: the fill threads.

    Returns each tree's ``max_rows`` for :func:`split_tree`, 0 where the tree stays whole.
    A tree is cut when it costs more than half a thread's fair share of the batch (the sum
    over ``threads``), into pieces of about half that share, so that threads taking work
    largest first end together; never into more pieces than threads or nodes.
    """
    known = [c for c in costs if c is not None and c > 0]
    out = [0] * len(costs)
    if threads <= 1 or not known:
        return out
    target = sum(known) / threads / 2
    for j, (c, n) in enumerate(zip(costs, sizes)):
        if c is None or c <= target or n < 2:
            continue
        pieces = min(threads, n, math.ceil(c / target))
        if pieces >= 2:
            out[j] = math.ceil(n / pieces)
    return out
