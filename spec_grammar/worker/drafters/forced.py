"""Grammar-forced draft tokens (jump-forward inside the draft tree) and grammar pruning of
drafted trees.

Where the grammar allows exactly one continuation (``SpecGrammar.forced_tokens()``: JSON
keys of required properties, ``", "`` separators, a tool's only name), the branch is extended
with those tokens at no model cost. They are drafts like any other: the target verifies
them, so a forced tokenization the target would not produce (a non-canonical split of the
forced text) is rejected and the target's own token is committed instead. Idea from
jump-forward decoding (SGLang's compressed FSM, LMSYS blog 2024-02-05) moved from the commit
path into the draft tree, as SGLang's ``is_jump_forward`` + speculative drafting discussion
(sgl-project/sglang#4329) suggests.

A :class:`GrammarDraft` carries a tree being built together with, per node, the grammar row
(the allowed set after root..node, in target vocabulary space, ``(W,)`` int32) when rows are
kept: those rows are exactly the verification rows of the final tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...tree import DraftTree

if TYPE_CHECKING:
    from ...protocol import SpecGrammar

__all__ = ["GrammarDraft", "walk_tree", "extend_with_forced"]


def _bit(row: torch.Tensor, t: int) -> bool:
    return bool((int(row[t >> 5]) >> (t & 31)) & 1)


@dataclass
class GrammarDraft:
    """A draft tree under construction: ``tokens`` / ``parents`` (node 0 = root, parents
    first), ``terminated[n]`` (node n's token ended the grammar) and, when kept, ``rows[n]``
    (``(W,)`` int32 CPU: the tokens allowed after root..n; zero for terminated nodes)."""

    tokens: list[int]
    parents: list[int]
    terminated: list[bool]
    rows: list[torch.Tensor] | None = None
    children: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.children:
            self.children = [[] for _ in self.tokens]
            for n in range(1, len(self.tokens)):
                self.children[self.parents[n]].append(n)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def add(
        self, token: int, parent: int, row: torch.Tensor | None, terminated: bool = False
    ) -> int:
        """Append a child of ``parent``; returns its index."""
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.terminated.append(terminated)
        self.children.append([])
        self.children[parent].append(len(self.tokens) - 1)
        if self.rows is not None:
            self.rows.append(row)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Tokens root..node, root excluded."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def depth(self, node: int) -> int:
        d = 0
        while node > 0:
            node = self.parents[node]
            d += 1
        return d

    def tree(self) -> DraftTree:
        return DraftTree(list(self.tokens), list(self.parents))

    def bitmask(self) -> torch.Tensor:
        """``(N, W)`` int32: the rows stacked in node order."""
        assert self.rows is not None
        return torch.stack(self.rows)


def walk_tree(
    matcher: SpecGrammar, tree: DraftTree, budget: int, *, fill_rows: bool
) -> GrammarDraft:
    """The valid part of ``tree`` under ``matcher`` (at the root's state), cut to ``budget``
    draft nodes in node order (the drafter's priority order; parents precede children).

    A node is valid when its parent is, its token is allowed by the parent's row (or, without
    rows, accepted by the matcher) — the rule of
    :func:`spec_grammar.traverse.fill_tree_bitmask_dfs`, whose accept/fill/rollback DFS this
    is, so the rows kept equal a fresh ``fill_tree_bitmask`` of the returned tree. The matcher
    ends in its starting state. Invalid nodes are dropped: they could never be accepted.
    """
    n = tree.num_nodes
    n_tok = matcher.info.tokenizer_vocab_size
    width = matcher.info.bitmask_width
    buf = torch.zeros((n, width), dtype=torch.int32) if fill_rows else None
    valid = [False] * n
    term = [False] * n
    valid[0] = True
    if fill_rows:
        matcher.fill_next_token_bitmask(buf, 0)
    stack = list(reversed(tree.children(0)))
    while stack:
        node = stack.pop()
        if node < 0:
            matcher.rollback(1)
            continue
        t = tree.token_list[node]
        if not 0 <= t < n_tok:
            continue
        if fill_rows and not _bit(buf[tree.parent_list[node]], t):
            continue
        if not matcher.accept_token(t):
            continue
        valid[node] = True
        stack.append(~node)
        if matcher.is_terminated():
            term[node] = True
            continue
        if fill_rows:
            matcher.fill_next_token_bitmask(buf, node)
        stack.extend(reversed(tree.children(node)))
    keep = [i for i in range(n) if valid[i]][: budget + 1]
    index = {old: new for new, old in enumerate(keep)}
    return GrammarDraft(
        tokens=[tree.token_list[i] for i in keep],
        parents=[-1 if i == 0 else index[tree.parent_list[i]] for i in keep],
        terminated=[term[i] for i in keep],
        rows=[buf[i] for i in keep] if fill_rows else None,
    )


def extend_with_forced(
    draft: GrammarDraft, leaf_matcher: Callable[[int], SpecGrammar], budget: int
) -> int:
    """Append the grammar-forced continuation under the leaves of ``draft``, deepest leaf
    first, until the tree holds ``budget`` draft nodes (root excluded). Rows of the new nodes
    are filled when ``draft.rows`` is kept.

    ``leaf_matcher(node)`` returns a matcher the caller no longer needs, at the state after
    root..node (a fork: it is advanced here). Returns the number of tokens added.
    """
    leaves = [
        n for n in range(draft.num_nodes) if not draft.children[n] and not draft.terminated[n]
    ]
    leaves.sort(key=lambda n: (-draft.depth(n), n))
    added = 0
    for leaf in leaves:
        free = budget - (draft.num_nodes - 1)
        if free <= 0:
            break
        m = leaf_matcher(leaf)
        if m is None or m.is_terminated():
            continue
        node = leaf
        for t in m.forced_tokens()[:free]:
            if not m.accept_token(t):
                break
            row = None
            if draft.rows is not None:
                row = torch.zeros(m.info.bitmask_width, dtype=torch.int32)
                if not m.is_terminated():
                    m.fill_next_token_bitmask(row.unsqueeze(0), 0)
            node = draft.add(t, node, row, m.is_terminated())
            added += 1
    return added
