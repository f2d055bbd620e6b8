"""The draft-tree mask of SGLang's speculative workers, filled by spec-grammar.

Every SGLang speculative worker (EAGLE family, STANDALONE, NGRAM, DFLASH, ...) builds its
grammar mask through ``sglang.srt.speculative.spec_utils.generate_token_bitmask``: a Python
depth-first walk per request (``traverse_tree``, SGLang PR #6499) that calls
``accept_token`` / ``fill_vocab_mask`` / ``rollback`` on the request's grammar object once per
node and tests each child's bit in its parent's row with tensor indexing.
:func:`generate_token_bitmask` here replaces it (through SGLang's plugin ``HookRegistry``,
see :func:`spec_grammar.integrations.sglang.register`) with one call per backend to
:meth:`~spec_grammar.protocol.GrammarBackend.fill_tree_bitmasks` over every request whose
grammar is a :class:`~.grammar.SGLangGrammar`: each adapter's batched tree fill (xgrammar's
native draft-tree traversal, llguidance's lean depth-first walks, each on a thread pool), with
the batch's dead rows found in one numpy pass.

The rows are SGLang's, bit for bit: row ``i * N + n`` holds the tokens allowed after the path
root..n of request ``i``; rows of nodes the grammar rejects (their token not allowed by the
parent's row, or not below ``vocab_size``), of nodes below them, and of nodes whose token
terminated the grammar keep the all-allowed ``-1`` of the allocation (verification never
reaches them), as do the rows of requests without a grammar or whose grammar is already
terminated. Requests whose grammar is another backend's object, or whose tree links are not
parent-before-child, go through SGLang's own ``traverse_tree`` unchanged. When the first grammar
is ours the mask is not initialized (as ``allocate_vocab_mask`` would, without its -1 pass;
on a host without CUDA a released mask of the last two calls is reused, see
:func:`_tree_mask`): the tree fills write the rows of live nodes only
(``zero_dead_rows=False``), every other row is set to -1 afterwards, so each row is written
once.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
from typing import Any

import numpy as np
import torch

from ...bitmask import bitmask_width
from ...errors import GrammarStateError
from ...tree import DraftTree
from .grammar import SGLangGrammar, allocate_mask

TARGET = "sglang.srt.speculative.spec_utils.generate_token_bitmask"
"""The SGLang function :func:`generate_token_bitmask` replaces."""


def _tree(tokens: list[int], next_token: list[int], next_sibling: list[int]) -> DraftTree | None:
    """The draft tree given by SGLang's first-child / next-sibling links, or None when a node
    is unreachable from the root or comes before its parent (SGLang's walk takes those)."""
    n = len(tokens)
    parents = [-2] * n
    parents[0] = -1
    ordered = next_sibling[0] == -1  # siblings by increasing index: the links are the tree's
    for p in range(n):  # a child comes after its parent: its parent is set before it is read
        if parents[p] == -2:
            return None
        c = next_token[p]
        while c != -1:
            if not p < c < n or parents[c] != -2:
                return None
            parents[c] = p
            s = next_sibling[c]
            if s != -1 and s < c:
                ordered = False
            c = s
    if ordered:
        return DraftTree._from_ordered_links(tokens, parents, next_token, next_sibling)
    return DraftTree(tokens, parents)


_reuse = threading.local()  # .masks: this thread's last tree masks (CPU-only hosts)
_KEEP = 2  # a step's mask may still be held while the next one is filled (overlap)


def _storage_users(t: torch.Tensor) -> int | None:
    """Tensors (views and numpy arrays included) holding ``t``'s memory, or None where this
    torch cannot tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return use_count(t.untyped_storage()._cdata) - 1  # the storage object made here


def _tree_mask(vocab_size: int, rows: int) -> torch.Tensor:
    """An uninitialized ``(rows, ceil(vocab_size / 32))`` int32 CPU mask for the tree fill.

    On a host without CUDA one of the last two masks of this shape is handed out again once
    nothing else holds its memory (SGLang drops it after the step's apply): a fresh buffer of
    32 MB or more comes from ``mmap`` and its first write page-faults, ~25 ms for the 64 MB of
    2,048 rows at a 262k vocabulary (measured on the development host, half of SGLang's whole
    walk there). With CUDA the mask is pinned and PyTorch's caching host allocator already
    reuses it once its copies are done, which a use count cannot see."""
    if torch.cuda.is_available():
        return allocate_mask(vocab_size, rows)
    width = bitmask_width(vocab_size)
    masks = [m for m in getattr(_reuse, "masks", ()) if m.shape == (rows, width)]
    free = next((m for m in masks if _storage_users(m) == 1), None)
    if free is None:
        free = allocate_mask(vocab_size, rows)
        masks = masks[-(_KEEP - 1) :] + [free]
    _reuse.masks = masks
    # a view: the caller's tensor counts as a user of the memory as long as it (or a view or
    # numpy array of it) lives, which the pool's own reference does not
    return free.view(rows, width)


@functools.cache
def _skips_dead_rows(backend_type: type) -> bool:
    """Whether ``backend_type.fill_tree_bitmasks`` takes ``zero_dead_rows`` (a third-party
    backend may override it with the older two-argument signature)."""
    params = inspect.signature(backend_type.fill_tree_bitmasks).parameters
    return "zero_dead_rows" in params


def _fill(backend: Any, group: list, mask: torch.Tensor) -> list[torch.Tensor]:
    if _skips_dead_rows(type(backend)):
        # dead rows are set to -1 afterwards: the fill need not zero them first
        return backend.fill_tree_bitmasks(group, mask, zero_dead_rows=False)
    return backend.fill_tree_bitmasks(group, mask)


def _fill_alone(
    reqs: list[Any],
    n: int,
    backend: Any,
    group: list,
    mask: torch.Tensor,
    untouched: list[int],
    walk: list[int],
) -> tuple[list, list[torch.Tensor]]:
    """The jobs of a failed group fill, each filled alone; those that fail again are added to
    ``untouched`` and ``walk``. Returns the jobs that filled and their valid flags."""
    done, valids = [], []
    for _, tree, off in group:
        g = reqs[off // n].grammar
        g.recover()
        job = (g.matcher, tree, off)
        try:
            valids.append(_fill(backend, [job], mask)[0])
            done.append(job)
        except GrammarStateError:
            g.recover()
            untouched.append(off // n)
            walk.append(off // n)
    return done, valids


def _dead_rows(group: list, valids: list[torch.Tensor], n: int) -> np.ndarray:
    """Rows of a backend's group (jobs ``(matcher, tree, row)``, each tree of ``n`` nodes) that
    SGLang's walk leaves all-allowed: rejected nodes, and nodes whose (stop) token terminated
    the grammar, the root's excepted; for the whole group in one numpy pass."""
    offs = np.fromiter((off for _, _, off in group), dtype=np.int64, count=len(group))
    rows = (offs[:, None] + np.arange(n)).ravel()
    dead = ~torch.cat(valids).numpy()
    tokens = np.fromiter(
        itertools.chain.from_iterable(tree.token_list for _, tree, _ in group),
        dtype=np.int64,
        count=len(rows),
    ).reshape(-1, n)
    stop = np.zeros(tokens.shape, dtype=bool)
    for t in group[0][0].info.stop_token_ids:  # one to three ids: np.isin costs 10x this
        stop |= tokens == t
    stop[:, 0] = False
    return rows[dead | stop.ravel()]


def generate_token_bitmask(
    reqs: list[Any],
    retrieve_next_token_cpu: torch.Tensor,
    retrieve_next_sibling_cpu: torch.Tensor,
    draft_tokens_cpu: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor | None, Any]:
    """SGLang's ``generate_token_bitmask`` (same arguments, same result), filled by
    spec-grammar's tree fills.

    Args:
        reqs: the batch's ``Req`` objects, ``bs`` of them; ``req.grammar`` is a grammar object
            or None.
        retrieve_next_token_cpu: ``(bs, N)`` int64, first child of each node (-1: none).
        retrieve_next_sibling_cpu: ``(bs, N)`` int64, next sibling of each node (-1: none).
        draft_tokens_cpu: ``(bs, N)`` int64 token ids; column 0 is each request's root, the
            token already committed.
        vocab_size: the logits width ``V``; tokens ``>= V`` (n-gram padding) are rejected.

    Returns:
        ``(mask, grammar)``: ``mask`` is ``(bs * N, ceil(V / 32))`` int32 on the CPU, allocated
        by the first grammar's ``allocate_vocab_mask`` (all -1), with the rows described in the
        module docstring; ``grammar`` is the batch's last grammar object (SGLang's handle for
        the static apply). ``(None, None)`` when no request has a grammar.

    A group fill that fails (:class:`~spec_grammar.errors.GrammarStateError`: a library
    matcher with no continuation at a draft node) is redone request by request after
    :meth:`~.grammar.SGLangGrammar.recover`; a request failing again is walked by SGLang's
    ``traverse_tree`` (the failing node's row all-zero). Every grammar is left in the state it
    had.
    """
    n = draft_tokens_cpu.shape[-1]
    assert len(reqs) == retrieve_next_token_cpu.shape[0]
    mask = None
    grammar = None
    untouched: list[int] = []  # requests whose rows no tree fill writes (all-allowed)
    jobs: dict[int, tuple[Any, list]] = {}  # id(backend) -> (backend, [(matcher, tree, row)])
    walk: list[int] = []  # requests left to SGLang's traverse_tree
    tokens = nxt = sib = None
    fits = None  # whether the mask is int32 on the CPU (the tree fills write host memory)
    for i, req in enumerate(reqs):
        g = req.grammar
        if g is None:
            untouched.append(i)
            continue
        if mask is None:
            if isinstance(g, SGLangGrammar):
                # what SGLang's walk gets from allocate_vocab_mask, minus the -1 pass over rows
                # that the tree fills overwrite: the rows left are set to -1 below
                mask = _tree_mask(vocab_size, draft_tokens_cpu.numel())
            else:
                mask = g.allocate_vocab_mask(
                    vocab_size=vocab_size, batch_size=draft_tokens_cpu.numel(), device="cpu"
                )
        grammar = g
        if not isinstance(g, SGLangGrammar):
            untouched.append(i)
            walk.append(i)
            continue
        if g.is_terminated():
            untouched.append(i)
            continue  # SGLang's walk fills nothing below a terminated root
        backend = g.backend
        if fits is None:
            fits = mask.dtype == torch.int32 and mask.device.type == "cpu"
        if not fits or mask.shape[1] != bitmask_width(g.matcher.info.vocab_size):
            untouched.append(i)
            walk.append(i)
            continue
        if tokens is None:
            tokens = draft_tokens_cpu.reshape(len(reqs), n).tolist()
            nxt = retrieve_next_token_cpu.tolist()
            sib = retrieve_next_sibling_cpu.tolist()
        ids = tokens[i]
        if max(ids) >= vocab_size:
            # rejected as SGLang's walk does; the tree keeps them as invalid nodes
            ids = [t if t < vocab_size else -1 for t in ids]
        tree = _tree(ids, nxt[i], sib[i])
        if tree is None:
            untouched.append(i)
            walk.append(i)
            continue
        key = id(backend)
        if key not in jobs:
            jobs[key] = (backend, [])
        jobs[key][1].append((g.matcher, tree, i * n))

    dead: list[np.ndarray] = []  # rows SGLang's walk leaves all-allowed
    for backend, group in jobs.values():
        try:
            valids = _fill(backend, group, mask)
        except GrammarStateError:
            # a library matcher failed (llguidance at a draft node with no continuation) and
            # the adapter trusts none of the group's: each request again alone, after
            # SGLangGrammar.recover; one failing again goes to SGLang's walk, whose
            # fill_vocab_mask gives the failing state an all-zero row
            group, valids = _fill_alone(reqs, n, backend, group, mask, untouched, walk)
        if group:
            dead.append(_dead_rows(group, valids, n))
    if mask is None:
        return None, None
    words = mask.numpy()  # numpy: torch's list indexing costs ms here
    if dead:
        words[np.concatenate(dead)] = -1
    for i in untouched:
        words[i * n : (i + 1) * n] = -1
    if walk:
        # imported here: spec_utils pulls in SGLang's kernels, which registration must not
        from sglang.srt.speculative.spec_utils import traverse_tree
    for i in walk:
        g = reqs[i].grammar
        mark = len(g.path) if isinstance(g, SGLangGrammar) else None
        try:
            traverse_tree(
                retrieve_next_token_cpu[i],
                retrieve_next_sibling_cpu[i],
                draft_tokens_cpu[i],
                g,
                mask[i * n : (i + 1) * n],
                vocab_size=vocab_size,
            )
        except BaseException:
            # SGLang's walk stops without its rollbacks (RecursionError on cyclic links, an
            # id < 0 it reads a bit for): ours go back to where they were
            if mark is not None and len(g.path) != mark:
                del g.path[mark:]
                g.recover()
            raise
    return mask, grammar
