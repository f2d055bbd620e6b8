"""Greedy verification of a whole batch with one mask upload and one device-to-host read-back.

The per-request path (:func:`~spec_grammar.worker.sampling.process_tree_logits` then
:func:`~spec_grammar.worker.verify.verify_greedy`) copies every request's mask and reads every
request's argmax back separately: ``B`` host synchronizations per step. For requests whose
processed logits are just the masked logits (temperature 0, no penalties, no logit bias) this
module does the same decision for the batch at once, on the stream the verify forward ran on:

1. the grammar rows of every request (one PINNED host bitmask, filled while the forward ran)
   go up with one ``non_blocking`` copy;
2. :func:`~spec_grammar.kernels.masked_argmax` (Triton on CUDA, torch elsewhere) gives the best
   allowed token of every grammar row without writing masked logits; rows of requests without a
   grammar take a plain ``argmax``;
3. one ``.tolist()`` brings ``B * N_max`` argmaxes back (the step's only read-back); the tree
   walk (:func:`~spec_grammar.worker.verify.greedy_walk`) runs on the host.

The argmax of ``masked_argmax`` equals ``apply_token_bitmask_inplace`` + ``argmax`` (first
index on ties) and ``-1`` marks a row that allows no token, so the result is exactly
``verify_greedy`` over ``process_tree_logits`` (the CPU tests check it against that oracle).
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from ..errors import BitmaskError, GrammarStateError
from ..kernels import masked_argmax
from ..tree import DraftTree
from .sampling import SamplingParams
from .verify import greedy_walk

__all__ = ["batch_greedy_eligible", "verify_greedy_batch"]

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
    device_bitmask: torch.Tensor | None = None,
    offsets: Sequence[int | None] = (),
    valids: Sequence[torch.Tensor | None] = (),
    stop_token_ids: Sequence[Collection[int]] = (),
) -> dict[int, Verified]:
    """Greedy-verify the requests ``selected`` of a verify forward.

    Args:
        logits: ``(B, N_max, V)`` float32 from :meth:`ModelRunner.forward_trees`, any device.
        trees: the ``B`` draft trees.
        selected: batch indices to verify (requests for which :func:`batch_greedy_eligible`).
        bitmask: ``(rows, W)`` int32 host tensor (pinned on CUDA) holding the grammar rows of
            every grammar request, request after request (``offsets``), or None. Its upload is
            queued ``non_blocking`` on the current stream: the caller keeps the buffer unchanged
            until that copy has run (the worker reuses buffers only after a CUDA event recorded
            after the step; :mod:`~spec_grammar.worker.host_bitmask`).
        device_bitmask: ``bitmask`` already on the logits' device (an upload started while the
            forward ran, :meth:`~.host_bitmask.HostBitmaskRing.upload`), used instead of
            uploading ``bitmask`` here when every one of its rows is needed.
        offsets: per batch index, the first bitmask row of its tree, or None (no grammar).
        valids: per batch index, ``(N,)`` bool node validity from the tree fill, or None.
        stop_token_ids: per batch index, tokens never expanded.

    Returns ``{batch index: (accepted nodes root first, bonus token)}``, or the
    :class:`GrammarStateError` of a request whose root row allows no token (the caller ends
    that request alone). Raises :class:`BitmaskError` when ``bitmask`` rows do not match the
    trees of the grammar requests.
    """
    if not selected:
        return {}
    b, n_max, vocab = logits.shape
    flat = logits.reshape(b * n_max, vocab)
    if len(selected) == b:
        sub, position = flat, {i: i for i in selected}
    else:
        sel = torch.tensor(list(selected), dtype=torch.long)
        rows = (sel[:, None] * n_max + torch.arange(n_max)).flatten()
        sub, position = flat[rows.to(flat.device, non_blocking=True)], {i: k for k, i in enumerate(selected)}
    masked = sorted((offsets[i], i) for i in selected if i < len(offsets) and offsets[i] is not None)

    def whole_mask() -> torch.Tensor:
        return device_bitmask if device_bitmask is not None else bitmask.to(flat.device, non_blocking=True)

    # every logits row a grammar row, in bitmask order (an all-grammar batch of full trees, the
    # common step): one masked argmax, no index upload, no unmasked argmax
    aligned = (
        len(masked) == b
        and bitmask is not None
        and bitmask.shape[0] == b * n_max
        and all(offsets[i] == i * n_max and trees[i].num_nodes == n_max for i in range(b))
    )
    best = masked_argmax(flat, whole_mask()) if aligned else sub.argmax(dim=-1)
    if masked and not aligned:
        if bitmask is None:
            raise BitmaskError("grammar requests need the step's bitmask")
        idx: list[int] = []
        mrows: list[int] = []
        for off, i in masked:
            n = trees[i].num_nodes
            idx.extend(position[i] * n_max + j for j in range(n))
            mrows.extend(range(off, off + n))
        pin = flat.is_cuda
        if mrows != list(range(bitmask.shape[0])):
            # a batch mixing greedy and sampled grammar requests: take only the rows needed
            dev_mask = bitmask[torch.tensor(mrows, dtype=torch.long)].to(flat.device, non_blocking=True)
        else:
            dev_mask = whole_mask()
        dev_idx = torch.tensor(idx, dtype=torch.long, pin_memory=pin).to(flat.device, non_blocking=True)
        best[dev_idx] = masked_argmax(sub, dev_mask, dev_idx)
    host = best.tolist()  # the step's one device-to-host synchronization
    out: dict[int, Verified] = {}
    for i in selected:
        tree = trees[i]
        n = tree.num_nodes
        base = position[i] * n_max
        best_i = host[base : base + n]
        alive = [t >= 0 for t in best_i]
        valid = valids[i] if i < len(valids) else None
        ok = [True] * n if valid is None else [bool(v) for v in valid.tolist()]
        stops = stop_token_ids[i] if i < len(stop_token_ids) else ()
        try:
            out[i] = greedy_walk(tree, best_i, alive, ok, vocab, stops)
        except GrammarStateError as e:
            out[i] = e
    return out
