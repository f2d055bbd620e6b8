"""Generic grammar work over draft trees, written once for every backend.

:func:`fill_tree_bitmask_dfs` is the reference tree fill (and the fallback of every adapter
without a native one): an iterative depth-first walk that accepts a node's token, fills its
row, visits its children and rolls back, as SGLang's ``traverse_tree`` does (SGLang PR #6499),
with the fixes its bug history asks for: out-of-range ids and padding are invalid nodes
instead of crashes, the validity of a child is read from its parent's row, and unreachable rows
are zero (fail closed) rather than all-allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .tree import DraftTree

if TYPE_CHECKING:
    from .protocol import SpecGrammar


def fill_tree_bitmask_dfs(
    matcher: SpecGrammar,
    tree: DraftTree,
    bitmask: torch.Tensor,
    row_offset: int = 0,
    *,
    zero_dead: bool = True,
) -> torch.Tensor:
    """Fill rows ``row_offset .. row_offset+N-1`` of ``bitmask`` for ``tree`` with
    accept/fill/rollback on ``matcher``'s hooks; returns the ``(N,)`` bool valid-node mask.
    Rows of dead nodes (invalid, below an invalid node, or terminated) are zeroed when
    ``zero_dead``, otherwise left as they were.

    Cost: one accept, one fill and one rollback per valid node; invalid subtrees are skipped.
    The matcher ends in the state it started in.
    """
    n = tree.num_nodes
    tokens = tree.token_list
    first_child = tree.first_child_list
    next_sibling = tree.next_sibling_list
    n_tok = matcher.info.tokenizer_vocab_size
    words = bitmask.numpy()
    filled = [False] * n  # rows written by a fill
    filled[0] = True
    valid = [False] * n
    valid[0] = True
    matcher._fill_next_token_bitmask(bitmask, row_offset)

    # Stack entries: child index to enter (>= 0) or ~node to leave (rollback one token).
    stack: list[int] = []
    c = first_child[0]
    children = []
    while c != -1:
        children.append(c)
        c = next_sibling[c]
    stack.extend(reversed(children))
    while stack:
        node = stack.pop()
        if node < 0:
            matcher._rollback(1)
            continue
        t = tokens[node]
        parent_row = row_offset + tree.parent_list[node]
        if not (0 <= t < n_tok and (int(words[parent_row, t >> 5]) >> (t & 31)) & 1):
            continue
        if not matcher._accept_token(t):
            continue  # mask and accept disagree: treat as invalid (fail closed)
        valid[node] = True
        stack.append(~node)
        if matcher._is_terminated():
            continue
        matcher._fill_next_token_bitmask(bitmask, row_offset + node)
        filled[node] = True
        children.clear()
        c = first_child[node]
        while c != -1:
            children.append(c)
            c = next_sibling[c]
        stack.extend(reversed(children))
    if zero_dead:
        dead = [row_offset + k for k in range(n) if not filled[k]]
        if dead:
            words[dead] = 0
    return torch.tensor(valid, dtype=torch.bool)


def single_allowed_token(row: np.ndarray) -> int | None:
    """The one token id set in a ``(W,)`` int32 row, or None when zero or several are set."""
    nz = np.flatnonzero(row)
    if len(nz) != 1:
        return None
    w = int(row[nz[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(nz[0]) * 32 + w.bit_length() - 1


def forced_tokens_by_mask(matcher: SpecGrammar, limit: int | None = None) -> list[int]:
    """Forced tokens found by filling masks: while exactly one non-stop token is allowed, take
    it, at most ``limit`` (default: the matcher's ``max_forced_tokens``) tokens, one mask fill
    each. Generic fallback for libraries without jump-forward; the matcher is unchanged."""
    if limit is None:
        limit = matcher.max_forced_tokens
    from .bitmask import allocate_token_bitmask, clear_padding_bits

    buf = allocate_token_bitmask(1, matcher.info.vocab_size)
    words = buf.numpy()[0]
    forced: list[int] = []
    try:
        while len(forced) < limit and not matcher._is_terminated():
            matcher._fill_next_token_bitmask(buf, 0)
            clear_padding_bits(buf, 0, 1, matcher.info.tokenizer_vocab_size)
            t = single_allowed_token(words)
            if t is None or matcher.is_stop_token(t) or not matcher._accept_token(t):
                break
            forced.append(t)
    finally:
        if forced:
            matcher._rollback(len(forced))
    return forced
