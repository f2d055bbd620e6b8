"""Draft-tree rows on llguidance's native matcher: one tree's depth-first walk, and the walks of
many requests' trees spread over threads with the batch's glue done in vectorized passes.

llguidance has no tree walk of its own: a tree's rows come from ``consume_token`` /
``unsafe_compute_mask_ptr`` / ``rollback`` on the request's matcher, node by node. Its mask
computation releases the GIL, so the walks of distinct matchers run side by side on Python
threads (the per-node Python between those calls is what holds the GIL, hence the lean loop of
:func:`walk_tree`). llguidance's ``LLExecutor`` computes one row per matcher per call: a tree
fill through it goes level by level with a matcher per node (copies, replays along paths), which
on a 2-core host was slower than one thread's walk.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch

from spec_grammar.errors import GrammarStateError
from spec_grammar.tree import DraftTree

from .rows import _count_nonzero, check_native, complete_row, complete_single
from .vocab import VocabIndex

__all__ = ["fill_trees", "walk_tree"]


def walk_tree(
    m: Any,
    tree: DraftTree,
    words: np.ndarray,
    row_offset: int,
    n_tok: int,
    stops: Collection[int],
    vocab: VocabIndex,
) -> list[bool]:
    """Fill the rows of ``tree``'s live nodes into ``words[row_offset + k]`` by a depth-first
    consume / rollback walk on the native matcher ``m`` (left as it was).

    ``words``: the ``(R, W)`` int32 bitmask, C-contiguous, ``W`` = llguidance's mask width. A
    child is entered only when its token is in ``[0, n_tok)`` and its bit is set in its
    parent's (completed) row (llguidance's error state is sticky, G4); a stop-token child is
    valid but never consumed and its row is not written; rows of invalid nodes are not
    written. Returns each node's validity (root: True). Raises :class:`GrammarStateError` when
    llguidance refuses a token its row allowed or its matcher fails."""
    tokens = tree.token_list
    parents = tree.parent_list
    first_child = tree.first_child_list
    next_sibling = tree.next_sibling_list
    n = len(tokens)
    width = words.shape[1]
    # a flat memoryview reads a word as a Python int in a fraction of numpy's scalar indexing
    flat = memoryview(words.reshape(-1))
    row_bytes = width * 4
    # not words.ctypes: building that object cost ~25 us, more than a tree's Python walk
    base = words.__array_interface__["data"][0]
    consume, compute, is_error = m.consume_token, m.unsafe_compute_mask_ptr, m.is_error
    valid = [False] * n
    valid[0] = True
    depth = [0] * n  # of each node pushed; the native matcher is at depth `at`
    compute(base + row_offset * row_bytes, row_bytes)
    check_native(m)
    complete_row(m, words[row_offset], vocab)
    stack = []
    c = first_child[0]
    while c != -1:
        depth[c] = 1
        stack.append(c)
        c = next_sibling[c]
    at = 0
    try:
        while stack:
            node = stack.pop()
            t = tokens[node]
            if not (
                0 <= t < n_tok
                and (flat[(row_offset + parents[node]) * width + (t >> 5)] >> (t & 31)) & 1
            ):
                continue
            valid[node] = True
            if t in stops:
                continue  # terminates: no row, no children
            d = depth[node]
            if at >= d:  # back up to the parent: one rollback for the whole way
                m.rollback(at - d + 1)
                at = d - 1
            if not consume(t):
                raise GrammarStateError(
                    f"llguidance refused token {t} that its row allowed: {m.get_error()}"
                )
            at = d
            r = row_offset + node
            compute(base + r * row_bytes, row_bytes)
            if is_error():
                check_native(m)
            row = words[r]
            if _count_nonzero(row) == 1:
                complete_single(m, row, vocab)
            c = first_child[node]
            while c != -1:
                depth[c] = d + 1
                stack.append(c)
                c = next_sibling[c]
    finally:
        if at:
            m.rollback(at)
    return valid


def fill_trees(
    jobs: Sequence[tuple[Any, DraftTree, int]],
    bitmask: torch.Tensor,
    *,
    n_tok: int,
    stops: Collection[int],
    vocab: VocabIndex,
    zero_dead: bool,
    submit: Callable[[Callable[[], None]], Any],
    threads: int,
) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
    """:func:`walk_tree` for each ``(native matcher, tree, row_offset)`` job (distinct native
    matchers), largest tree first, on the calling thread and ``threads - 1`` helpers started
    by ``submit(fn)`` (which runs ``fn()`` on another thread). The jobs are taken one at a time
    from a shared counter and the call returns once every job is done: it never waits for a
    helper that took no job (on a busy host a helper may start only after the caller has
    walked every tree; it then finds none left).

    Then, for the whole batch in a few numpy passes: the dead rows (invalid nodes, non-root
    stop-token nodes) are zeroed when ``zero_dead``, and the ids ``>= n_tok`` of every live
    row cleared. Returns each job's ``(N,)`` bool validity (None for a job whose walk failed)
    and the failed jobs' errors by job index; a failed job's rows are unspecified."""
    words = bitmask.numpy()
    valids: list[list[bool] | None] = [None] * len(jobs)
    errors: dict[int, BaseException] = {}
    if not jobs:
        return [], errors
    order = sorted(range(len(jobs)), key=lambda j: -jobs[j][1].num_nodes)
    taken = itertools.count()
    left = [len(jobs)]
    lock = threading.Lock()
    done = threading.Event()

    def share() -> None:
        # next() of itertools.count is atomic under the GIL: each job runs once
        while (i := next(taken)) < len(order):
            j = order[i]
            m, tree, off = jobs[j]
            try:
                valids[j] = walk_tree(m, tree, words, off, n_tok, stops, vocab)
            except Exception as e:  # noqa: BLE001  (reported per job, the others still fill)
                errors[j] = e
            finally:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

    for _ in range(min(threads, len(jobs)) - 1):
        submit(share)
    share()
    done.wait()
    done = [j for j, v in enumerate(valids) if v is not None]
    if not done:
        return [None] * len(jobs), errors
    sizes = [jobs[j][1].num_nodes for j in done]
    chain = itertools.chain.from_iterable
    total = sum(sizes)
    valid = np.fromiter(chain(valids[j] for j in done), dtype=bool, count=total)
    tokens = np.fromiter(chain(jobs[j][1].token_list for j in done), dtype=np.int64, count=total)
    starts = np.zeros(len(done) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    offs = np.array([jobs[j][2] for j in done], dtype=np.int64)
    rows = np.repeat(offs - starts[:-1], sizes) + np.arange(total)
    dead = ~valid
    for t in stops:  # one to three ids: np.isin costs 10x this
        dead |= tokens == t
    dead[starts[:-1]] = False  # a root is valid, its row live whatever its token
    if zero_dead and dead.any():
        words[rows[dead]] = 0
    if n_tok < 32 * words.shape[1]:
        live = rows[~dead]
        word, bit = divmod(n_tok, 32)
        if bit:
            words[live, word] &= (1 << bit) - 1
            word += 1
        if word < words.shape[1]:
            words[live, word:] = 0
    out: list[torch.Tensor | None] = [None] * len(jobs)
    for j, v in zip(done, torch.from_numpy(valid).split(sizes)):
        out[j] = v
    return out, errors
