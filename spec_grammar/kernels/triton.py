"""CUDA apply: one Triton launch, no host synchronization, safe inside a CUDA graph.

Each program takes ``WORDS`` mask words (``32 * WORDS`` tokens) of one row as a
``(WORDS, 32)`` tile, so every per-word decision is constant along the vectorized axis and
loads/stores stay 16 bytes wide. Per word:

* all ones (every token allowed): nothing is read or written;
* all zeros, or past the mask's width (padded vocab): ``-inf`` is written, nothing is read;
* mixed: the 32 logits are read and written back with the disallowed ones set to ``-inf``.

So the bytes moved are at most one read and one write of the logits plus one read of the
mask (random masks), about half of that for grammar masks (mostly all-zero words) and only the
mask for unconstrained rows. xgrammar's Triton kernel instead stores ``-inf`` with a
per-element predicate, which splits each vector store into scalar ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 4 KiB of logits per program and 4 warps: the fastest of seven (words, warps) pairs for fp32
# and bf16 at every swept shape on an H200 (benchmarks/bench_kernels.py --sweep, results in
# benchmarks/results/kernels-h200-sweep.json).
BYTES_PER_PROGRAM = 4096
NUM_WARPS = 4


@triton.jit
def _apply_kernel(
    logits_ptr,
    mask_ptr,
    idx_ptr,
    vocab,
    width,
    logits_stride,
    mask_stride,
    blocks_per_row,
    HAS_INDICES: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // blocks_per_row
    blk = pid % blocks_per_row
    if HAS_INDICES:
        lrow = tl.load(idx_ptr + row).to(tl.int64)
    else:
        lrow = row.to(tl.int64)
    w = blk * WORDS + tl.arange(0, WORDS)
    # Words past the mask's width read as 0: padded-vocab columns are disallowed.
    word = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + w, mask=w < width, other=0)
    bit = tl.arange(0, 32)
    cols = w[:, None] * 32 + bit[None, :]
    in_row = cols < vocab
    allowed = ((word[:, None] >> bit[None, :]) & 1) != 0
    mixed = (word != 0) & (word != -1)
    ptrs = logits_ptr + lrow * logits_stride + cols
    x = tl.load(ptrs, mask=mixed[:, None] & in_row, other=0.0)
    tl.store(ptrs, tl.where(allowed, x, float("-inf")), mask=(word != -1)[:, None] & in_row)


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    indices: torch.Tensor | None = None,
    words_per_program: int | None = None,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch :func:`_apply_kernel` over ``(rows, ceil(V / (32 * words_per_program)))`` programs
    (default: 4 KiB of logits per program).

    ``logits``: ``(rows, V)`` CUDA float32/float16/bfloat16 with unit column stride;
    ``bitmask``: ``(n, W)`` int32 with unit column stride, ``n = len(indices)`` or ``rows``;
    ``indices``: int32/int64 CUDA tensor or ``None``. Checked by the dispatcher.
    """
    n = bitmask.shape[0] if indices is not None else logits.shape[0]
    vocab = logits.shape[1]
    if words_per_program is None:
        words_per_program = BYTES_PER_PROGRAM // (32 * logits.element_size())
    blocks = triton.cdiv(vocab, 32 * words_per_program)
    if n == 0 or blocks == 0:
        return
    _apply_kernel[(n * blocks,)](
        logits,
        bitmask,
        indices,
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        blocks,
        HAS_INDICES=indices is not None,
        WORDS=words_per_program,
        num_warps=num_warps,
    )
