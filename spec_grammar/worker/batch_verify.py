"""Greedy verification of a whole batch with one device-to-host read-back.

The per-request path (:func:`~spec_grammar.worker.sampling.process_tree_logits` then
:func:`~spec_grammar.worker.verify.verify_greedy`) copies every request's mask and reads every
request's argmax back separately: ``B`` host synchronizations per step. For requests whose
processed logits are just the masked logits (temperature 0, no penalties, no logit bias) this
module does the same decision for the batch at once:

1. every row's unmasked greedy token (:func:`~spec_grammar.kernels.row_argmax`; the runner
   computes it inside its CUDA graph) comes back with one ``.tolist()``;
2. the tree walks (:func:`~spec_grammar.worker.verify.greedy_walk`) run on the host on those
   tokens; for each grammar row a walk visited, the host reads ONE word of the step's host
   bitmask (filled while the forward ran): when the grammar allows the row's greedy token, that
   token is the row's masked argmax too (it is the first index of the row's maximum, so no
   allowed token before it ties with it), and a row whose logits are all ``-inf`` is ``-1``
   under any mask;
3. only visited rows whose grammar forbids the greedy token (the model wants a token its
   grammar forbids) are masked on the device: their bitmask rows go up,
   :func:`~spec_grammar.kernels.masked_argmax` gives their best allowed token (a second
   read-back, only in steps that have such rows) and those walks run again. Rows of rejected
   branches are never read: a step's check costs a few words per request, not its tree.

With a model that mostly agrees with its grammar, a constrained step then costs what an
unconstrained one does: no bitmask upload and no masked kernel (before, the whole bitmask went
up and a masked argmax ran over every row: two Triton launches and a stream wait, 0.1-0.2 ms of
host time that a 1.3 ms forward of a small model could not hide). The result is exactly
``verify_greedy`` over ``process_tree_logits`` (the CPU tests check it against that oracle).
"""

from __future__ import annotations

from typing import Collection, Sequence

import numpy as np
import torch

from .. import kernels
from ..errors import BitmaskError, GrammarStateError
from ..kernels import masked_argmax
from ..tree import DraftTree
from .sampling import SamplingParams
from .verify import greedy_walk

__all__ = ["batch_greedy_eligible", "launch_masked_rows", "verify_greedy_batch"]

Verified = tuple[list[int], int] | GrammarStateError


def batch_greedy_eligible(params: SamplingParams) -> bool:
    """True when a request's processed logits are the masked raw logits and verification is
    greedy, i.e. :func:`verify_greedy_batch` decides exactly as the per-request path."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and not params.logit_bias
        and not params.logprobs
    )


def verify_greedy_batch(
    logits: torch.Tensor,
    trees: Sequence[DraftTree],
    selected: Sequence[int],
    *,
    bitmask: torch.Tensor | None = None,
    offsets: Sequence[int | None] = (),
    valids: Sequence[torch.Tensor | None] = (),
    stop_token_ids: Sequence[Collection[int]] = (),
    row_argmax: torch.Tensor | None = None,
    masked_rows: torch.Tensor | None = None,
    stats: dict | None = None,
) -> dict[int, Verified]:
    """Greedy-verify the requests ``selected`` of a verify forward.

    Args:
        logits: ``(B, N_max, V)`` float32 from :meth:`ModelRunner.forward_trees`, any device.
        trees: the ``B`` draft trees.
        selected: batch indices to verify (requests for which :func:`batch_greedy_eligible`).
        bitmask: ``(rows, W)`` int32 host tensor holding the grammar rows of every grammar
            request (``offsets``), or None. Only single words are read on the host; rows the
            device needs are copied out of it before this returns.
        offsets: per batch index, the first bitmask row of its tree, or None (no grammar).
        valids: per batch index, ``(N,)`` bool node validity from the tree fill, or None.
        stop_token_ids: per batch index, tokens never expanded.
        row_argmax: ``(B, N_max)`` int64 on the logits' device, the
            :func:`~spec_grammar.kernels.row_argmax` of ``logits`` (the runner's graph computes
            it: ``forward_trees(..., with_argmax=True)``); computed here when None.
        masked_rows: ``(rows,)`` int64 on the logits' device, the masked argmax of every
            bitmask row queued while the forward ran (:func:`launch_masked_rows`): read back
            with the greedy tokens, it replaces the device round trip of step 3.
        stats: if given, ``stats["forbidden_rows"]`` is set to the number of rows the walks
            visited whose grammar forbids their greedy token.

    Returns ``{batch index: (accepted nodes root first, bonus token)}``, or the
    :class:`GrammarStateError` of a request whose root row allows no token (the caller ends
    that request alone). Raises :class:`BitmaskError` when grammar requests come without a
    bitmask or their rows lie outside it.
    """
    if not selected:
        return {}
    b, n_max, vocab = logits.shape
    # everything that needs no logits first: the device may still be computing them
    masked = [(offsets[i], i) for i in selected if i < len(offsets) and offsets[i] is not None]
    rows_of = _grammar_rows(bitmask, masked, trees, b, n_max)
    words = bitmask.numpy() if masked else None
    oks = {i: _node_ok(trees[i].num_nodes, valids[i] if i < len(valids) else None) for i in selected}
    stops = {i: stop_token_ids[i] if i < len(stop_token_ids) else () for i in selected}
    top = row_argmax if row_argmax is not None else kernels.row_argmax(logits)
    flat_top = top.reshape(b * n_max)
    if masked_rows is None:
        best, early = flat_top.tolist(), None  # the step's one device-to-host synchronization
    else:
        both = torch.cat([flat_top, masked_rows]).tolist()
        best, early = both[: b * n_max], both[b * n_max :]
    resolved: set[int] = set()  # rows whose masked argmax replaced the greedy token
    out: dict[int, Verified] = {}
    todo = list(selected)
    while todo:
        unknown: list[int] = []
        retry = []
        for i in todo:
            base, n = i * n_max, trees[i].num_nodes
            best_i = best[base : base + n]
            try:
                out[i] = greedy_walk(trees[i], best_i, [t >= 0 for t in best_i], oks[i], vocab, stops[i])
            except GrammarStateError as e:
                out[i] = e
            visited = out[i][0] if isinstance(out[i], tuple) else [0]
            rows = [
                r for r in (base + node for node in visited)
                if rows_of[r] >= 0 and r not in resolved and not _allows(words, rows_of[r], best[r])
            ]
            if rows:  # the walk read a row whose greedy token its grammar forbids
                unknown.extend(rows)
                retry.append(i)
        if unknown:
            if early is not None:
                for r in unknown:
                    best[r] = early[rows_of[r]]
            else:
                _resolve(logits.reshape(b * n_max, vocab), best, bitmask, rows_of, unknown)
            resolved.update(unknown)
        todo = retry
    if stats is not None:
        stats["forbidden_rows"] = len(resolved)
    return out


def launch_masked_rows(
    logits: torch.Tensor, device_bitmask: torch.Tensor, trees: Sequence[DraftTree], offsets: Sequence[int | None]
) -> torch.Tensor | None:
    """Queue the masked argmax of every bitmask row on the logits' stream; no synchronization.

    Args:
        logits: ``(B, N_max, V)`` (its forward may still be running).
        device_bitmask: ``(rows, W)`` int32 on the logits' device, the step's bitmask.
        trees, offsets: as in :func:`verify_greedy_batch`.

    Returns ``(rows,)`` int64 (:func:`~spec_grammar.kernels.masked_argmax` of bitmask row ``k``
    over its logits row) for ``masked_rows``, or None when the bitmask rows are not exactly the
    trees' rows one request after another (a request whose fill failed left a gap).
    """
    b, n_max, vocab = logits.shape
    idx: list[int] = []
    for off, i in sorted((off, i) for i, off in enumerate(offsets) if off is not None):
        if off != len(idx):
            return None
        idx.extend(range(i * n_max, i * n_max + trees[i].num_nodes))
    if len(idx) != device_bitmask.shape[0]:
        return None
    flat = logits.reshape(b * n_max, vocab)
    if idx == list(range(b * n_max)):  # every row, in order (full trees, requests in order)
        return masked_argmax(flat, device_bitmask)
    rows = torch.tensor(idx, pin_memory=flat.is_cuda).to(flat.device, non_blocking=True)
    return masked_argmax(flat, device_bitmask, rows)


def _allows(words: np.ndarray, row: int, token: int) -> bool:
    """Whether ``token`` (a row's greedy token) is final under bitmask ``row``: allowed by it,
    or ``-1`` (the row's logits are all ``-inf``: ``-1`` under any mask)."""
    if token < 0:
        return True
    return token < words.shape[1] * 32 and (int(words[row, token >> 5]) >> (token & 31)) & 1 == 1


def _node_ok(n: int, valid: torch.Tensor | None) -> list[bool]:
    """Per node, grammar validity as a list (all True without a grammar)."""
    return [True] * n if valid is None else valid.bool().tolist()


def _grammar_rows(
    bitmask: torch.Tensor | None, masked: Sequence[tuple[int, int]], trees: Sequence[DraftTree], b: int, n_max: int
) -> list[int]:
    """Per logits row (``B * N_max``), its bitmask row, -1 for rows without a grammar.
    ``masked``: ``(first bitmask row, batch index)`` per grammar request."""
    rows_of = [-1] * (b * n_max)
    if not masked:
        return rows_of
    if bitmask is None:
        raise BitmaskError("grammar requests need the step's bitmask")
    if bitmask.device.type != "cpu":
        raise BitmaskError(f"the step's bitmask must be a host tensor, got one on {bitmask.device}")
    for off, i in masked:
        n = trees[i].num_nodes
        if off < 0 or off + n > bitmask.shape[0]:
            raise BitmaskError(
                f"request {i}'s tree of {n} nodes needs bitmask rows {off}..{off + n - 1}, "
                f"the bitmask has {bitmask.shape[0]}"
            )
        rows_of[i * n_max : i * n_max + n] = range(off, off + n)
    return rows_of


def _resolve(flat: torch.Tensor, best: list[int], bitmask: torch.Tensor, rows_of: list[int], rows: list[int]) -> None:
    """The masked argmax of logits ``rows`` (their bitmask rows go up) into ``best``."""
    dev = flat.device
    mask = bitmask[torch.tensor([rows_of[r] for r in rows])].to(dev, non_blocking=True)
    for r, t in zip(rows, masked_argmax(flat, mask, torch.tensor(rows).to(dev, non_blocking=True)).tolist()):
        best[r] = t
