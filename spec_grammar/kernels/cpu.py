"""Torch paths for every kernel: the CPU implementation and the fallback on any other device.

The apply works on the logits' bit patterns with integer ops, because every one of them is
vectorized by ATen on the CPU, whereas ``masked_fill_`` and ``torch.where`` with a bool mask
measured more than 10x slower per element here. For each allowed-mask word the 32 bits are
spread into a ``{0, -1}`` integer per token (shift left to the sign bit, then arithmetic shift
right), and the logits become ``((x ^ NEG) & keep) ^ NEG`` where ``NEG`` is the bit pattern of
``-inf`` in the logits' dtype: allowed tokens keep their exact bits, disallowed ones become
exactly ``-inf`` (also from NaN or ``+inf``). The ``& keep`` runs over row chunks of about
:data:`CHUNK_TOKENS` tokens per thread so the one temporary (one integer per token, in the
logits' width) stays in cache.

The fused verification fallbacks apply the mask to a copy of each row chunk and call
``torch.argmax`` (:func:`masked_argmax_torch`) or ``torch.softmax`` on float32
(:func:`masked_softmax_torch`); they define the results the Triton kernels in :mod:`.fused`
must match.
"""

from __future__ import annotations

import torch

#: Tokens per row chunk and torch thread: each thread's share of the ``{0, -1}`` temporary is
#: 256 KiB (int32) or 128 KiB, so it stays in the core's cache.
CHUNK_TOKENS = 1 << 16

# Integer view of each float dtype, the bit pattern of -inf in it, and its width in bits.
_INT_VIEW = {
    torch.float32: (torch.int32, -0x00800000, 32),  # 0xFF800000
    torch.bfloat16: (torch.int16, -0x0080, 16),  # 0xFF80
    torch.float16: (torch.int16, -0x0400, 16),  # 0xFC00
}
_SHIFTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _shifts(device: torch.device, int_dtype: torch.dtype, bits: int) -> torch.Tensor:
    """``bits - 1 - arange(bits)``: moves bit ``b`` of a mask word to the sign bit."""
    key = (device, int_dtype)
    s = _SHIFTS.get(key)
    if s is None:
        s = _SHIFTS[key] = torch.arange(bits - 1, -1, -1, dtype=int_dtype, device=device)
    return s


def keep_words(bitmask: torch.Tensor, int_dtype: torch.dtype, bits: int) -> torch.Tensor:
    """``(rows, W)`` int32 bitmask -> ``(rows, 32 * W)`` of ``int_dtype``: -1 allowed, 0 not.

    For 16-bit dtypes each int32 word is read as two int16 halves (little-endian: bits 0-15
    first), so the temporary is 2 bytes per token.
    """
    rows = bitmask.shape[0]
    words = bitmask.contiguous()
    if bits == 16:
        words = words.view(torch.int16)
    spread = words.unsqueeze(-1) << _shifts(bitmask.device, int_dtype, bits)
    spread >>= bits - 1
    return spread.view(rows, -1)


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_TOKENS * torch.get_num_threads() // max(vocab, 1))


def _apply_rows(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mask ``logits`` (any strides) with ``bitmask`` (same rows), chunk by chunk."""
    rows, v = logits.shape
    covered = min(v, bitmask.shape[1] * 32)
    int_dtype, neg, bits = _INT_VIEW[logits.dtype]
    x = logits[:, :covered].view(int_dtype)
    x ^= neg
    step = _rows_per_chunk(covered)
    for r0 in range(0, rows, step):
        x[r0 : r0 + step] &= keep_words(bitmask[r0 : r0 + step], int_dtype, bits)[:, :covered]
    x ^= neg
    if covered < v:
        logits[:, covered:] = float("-inf")


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, *, indices: torch.Tensor | None = None
) -> None:
    """``logits[rows, ~allowed] = -inf`` in place; columns past ``32 * W`` are disallowed.

    ``logits`` may have any strides. ``indices`` is a long tensor on ``logits.device`` (already
    checked by the dispatcher); the selected rows are gathered, masked and scattered back.
    """
    if indices is None:
        _apply_rows(logits, bitmask)
        return
    step = _rows_per_chunk(logits.shape[1])
    for i0 in range(0, indices.shape[0], step):
        idx = indices[i0 : i0 + step]
        sub = logits.index_select(0, idx)
        _apply_rows(sub, bitmask[i0 : i0 + step])
        logits.index_copy_(0, idx, sub)


def masked_argmax_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, *, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch path of :func:`spec_grammar.kernels.masked_argmax` (same arguments and result):
    the mask applied to a copy of each row chunk, then ``argmax``. (Greedy verification asks
    only for rows whose unmasked greedy token the grammar forbids:
    :mod:`spec_grammar.worker.batch_verify` checks the others on the host.)"""
    n = logits.shape[0] if indices is None else indices.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    # argmax parallelizes over rows: give every thread at least one row per chunk.
    step = max(torch.get_num_threads(), _rows_per_chunk(logits.shape[1]))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        x = logits[r0:r1].clone() if indices is None else logits.index_select(0, indices[r0:r1])
        _apply_rows(x, bitmask[r0:r1])
        arg = x.argmax(dim=1)
        best = x.gather(1, arg.unsqueeze(1)).squeeze(1)
        out[r0:r1] = arg.masked_fill_(best == float("-inf"), -1)
    return out


def masked_softmax_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    log: bool = False,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch path of :func:`spec_grammar.kernels.masked_softmax` (same arguments and result)."""
    n = logits.shape[0] if indices is None else indices.shape[0]
    out = torch.empty(n, logits.shape[1], dtype=torch.float32, device=logits.device)
    step = _rows_per_chunk(logits.shape[1])
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = slice(r0, r1) if indices is None else indices[r0:r1]
        x = logits[rows].to(torch.float32, copy=True)
        _apply_rows(x, bitmask[r0:r1])
        t = temperature if isinstance(temperature, float) else temperature[r0:r1, None]
        x /= t
        res = torch.log_softmax(x, dim=1) if log else torch.softmax(x, dim=1)
        empty = (x == float("-inf")).all(dim=1)
        if bool(empty.any()):
            # Nothing allowed gives NaN (-inf - -inf); defined as p = 0, log p = -inf.
            res[empty] = float("-inf") if log else 0.0
        out[r0:r1] = res
    return out
