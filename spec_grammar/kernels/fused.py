"""CUDA fused verification kernels (Triton): masked argmax and masked (log-)softmax.

The mask is applied in registers; masked logits are never written. Loads of all-zero mask
words are skipped (their tokens are not read at all), so a grammar mask that allows few tokens
costs little more than reading the mask.

Each row is split into ``splits`` chunks so that small batches still fill the GPU: a first
launch reduces every chunk to a partial (argmax: best value and its first index; softmax:
running max and sum of exponentials, the online-softmax recurrence of Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018), a second launch combines a row's partials
(argmax) or combines them and writes the row's probabilities (softmax). With one chunk per row
the argmax needs one launch. No host synchronization; safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS_PER_BLOCK = 64  # 2048 tokens per loop step
NUM_WARPS = 4
TARGET_PROGRAMS = 1024  # enough programs per launch to fill 132 SMs several times over
_NO_INDEX = tl.constexpr(2**31 - 1)  # "no allowed token seen"


@triton.jit
def _masked_block(
    logits_ptr,
    mask_ptr,
    lrow,
    mrow,
    w0,
    vocab,
    width,
    logits_stride,
    mask_stride,
    WORDS: tl.constexpr,
):
    """float32 logits of tokens ``[32*w0, 32*(w0+WORDS))`` with disallowed ones at -inf, and the
    token ids, both ``(WORDS, 32)``."""
    w = w0 + tl.arange(0, WORDS)
    word = tl.load(mask_ptr + mrow * mask_stride + w, mask=w < width, other=0)
    bit = tl.arange(0, 32)
    cols = w[:, None] * 32 + bit[None, :]
    ok = (((word[:, None] >> bit[None, :]) & 1) != 0) & (cols < vocab)
    x = tl.load(
        logits_ptr + lrow * logits_stride + cols,
        mask=(word != 0)[:, None] & (cols < vocab),
        other=0.0,
    )
    return tl.where(ok, x.to(tl.float32), float("-inf")), cols


@triton.jit
def _argmax_partial_kernel(
    logits_ptr,
    mask_ptr,
    idx_ptr,
    val_ptr,
    arg_ptr,
    vocab,
    width,
    logits_stride,
    mask_stride,
    splits,
    words_per_split,
    HAS_INDICES: tl.constexpr,
    FINAL: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // splits
    part = pid % splits
    lrow = tl.load(idx_ptr + row).to(tl.int64) if HAS_INDICES else row.to(tl.int64)
    mrow = row.to(tl.int64)
    best = tl.full((WORDS, 32), float("-inf"), tl.float32)
    best_i = tl.full((WORDS, 32), _NO_INDEX, tl.int32)
    w0 = part * words_per_split
    w_end = w0 + words_per_split
    while w0 < w_end:  # a while loop: older Triton interpreters cannot range() over arguments
        x, cols = _masked_block(
            logits_ptr, mask_ptr, lrow, mrow, w0, vocab, width, logits_stride, mask_stride, WORDS
        )
        # Strict '>' keeps the first index per lane; lanes see increasing ids.
        better = x > best
        best = tl.where(better, x, best)
        best_i = tl.where(better, cols, best_i)
        w0 += WORDS
    m = tl.max(tl.max(best, axis=1), axis=0)
    i = tl.min(tl.min(tl.where(best == m, best_i, _NO_INDEX), axis=1), axis=0)
    if FINAL:
        tl.store(arg_ptr + row, tl.where(m == float("-inf"), -1, i).to(tl.int64))
    else:
        tl.store(val_ptr + pid, m)
        tl.store(arg_ptr + pid, i)


@triton.jit
def _argmax_combine_kernel(val_ptr, arg_ptr, out_ptr, splits, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    v = tl.load(val_ptr + row * splits + s, mask=s < splits, other=float("-inf"))
    a = tl.load(arg_ptr + row * splits + s, mask=s < splits, other=_NO_INDEX)
    m = tl.max(v, axis=0)
    i = tl.min(tl.where(v == m, a, _NO_INDEX), axis=0)
    tl.store(out_ptr + row, tl.where(m == float("-inf"), -1, i).to(tl.int64))


@triton.jit
def _row_temperature(t_ptr, row, temperature, HAS_T_TENSOR: tl.constexpr):
    if HAS_T_TENSOR:
        return tl.load(t_ptr + row).to(tl.float32)
    return temperature


@triton.jit
def _softmax_partial_kernel(
    logits_ptr,
    mask_ptr,
    idx_ptr,
    t_ptr,
    m_ptr,
    s_ptr,
    temperature,
    vocab,
    width,
    logits_stride,
    mask_stride,
    splits,
    words_per_split,
    HAS_INDICES: tl.constexpr,
    HAS_T_TENSOR: tl.constexpr,
    WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // splits
    part = pid % splits
    lrow = tl.load(idx_ptr + row).to(tl.int64) if HAS_INDICES else row.to(tl.int64)
    mrow = row.to(tl.int64)
    t = _row_temperature(t_ptr, row, temperature, HAS_T_TENSOR)
    run_m = tl.full((WORDS, 32), float("-inf"), tl.float32)
    run_s = tl.zeros((WORDS, 32), tl.float32)
    w0 = part * words_per_split
    w_end = w0 + words_per_split
    while w0 < w_end:
        x, cols = _masked_block(
            logits_ptr, mask_ptr, lrow, mrow, w0, vocab, width, logits_stride, mask_stride, WORDS
        )
        z = x / t
        new_m = tl.maximum(run_m, z)
        # A lane that has seen only -inf keeps sum 0 (avoids exp(-inf - -inf) = NaN).
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)
        run_s = run_s * tl.exp(run_m - ref) + tl.exp(z - ref)
        run_m = new_m
        w0 += WORDS
    m = tl.max(tl.max(run_m, axis=1), axis=0)
    ref = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.sum(run_s * tl.exp(run_m - ref), axis=1), axis=0)
    tl.store(m_ptr + pid, m)
    tl.store(s_ptr + pid, s)


@triton.jit
def _softmax_write_kernel(
    logits_ptr,
    mask_ptr,
    idx_ptr,
    t_ptr,
    m_ptr,
    s_ptr,
    out_ptr,
    temperature,
    vocab,
    width,
    logits_stride,
    mask_stride,
    out_stride,
    splits,
    words_per_split,
    HAS_INDICES: tl.constexpr,
    HAS_T_TENSOR: tl.constexpr,
    LOG: tl.constexpr,
    WORDS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // splits
    part = pid % splits
    lrow = tl.load(idx_ptr + row).to(tl.int64) if HAS_INDICES else row.to(tl.int64)
    mrow = row.to(tl.int64)
    t = _row_temperature(t_ptr, row, temperature, HAS_T_TENSOR)
    sp = tl.arange(0, SPLITS)
    pm = tl.load(m_ptr + row * splits + sp, mask=sp < splits, other=float("-inf"))
    ps = tl.load(s_ptr + row * splits + sp, mask=sp < splits, other=0.0)
    m = tl.max(pm, axis=0)
    ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(ps * tl.exp(pm - ref), axis=0)
    # Nothing allowed: lse = +inf makes every output exp(-inf) = 0 / log p = -inf.
    lse = tl.where(m == float("-inf"), float("inf"), m + tl.log(total))
    w0 = part * words_per_split
    w_end = w0 + words_per_split
    while w0 < w_end:
        x, cols = _masked_block(
            logits_ptr, mask_ptr, lrow, mrow, w0, vocab, width, logits_stride, mask_stride, WORDS
        )
        y = x / t - lse
        if not LOG:
            y = tl.exp(y)
        tl.store(out_ptr + mrow * out_stride + cols, y, mask=cols < vocab)
        w0 += WORDS


def _splits(n: int, vocab: int) -> tuple[int, int]:
    """(chunks per row, words per chunk): enough programs to fill the GPU, whole loop steps."""
    steps = triton.cdiv(vocab, 32 * WORDS_PER_BLOCK)
    splits = max(1, min(steps, triton.cdiv(TARGET_PROGRAMS, max(n, 1))))
    steps_per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, steps_per_split)
    return splits, steps_per_split * WORDS_PER_BLOCK


def masked_argmax_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, *, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """CUDA path of :func:`spec_grammar.kernels.masked_argmax` (inputs checked by the caller)."""
    n = bitmask.shape[0]
    vocab = logits.shape[1]
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    splits, words = _splits(n, vocab)
    common = (vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0), splits, words)
    if splits == 1:
        _argmax_partial_kernel[(n,)](
            logits,
            bitmask,
            indices,
            out,
            out,
            *common,
            HAS_INDICES=indices is not None,
            FINAL=True,
            WORDS=WORDS_PER_BLOCK,
            num_warps=NUM_WARPS,
        )
        return out
    val = torch.empty(n * splits, dtype=torch.float32, device=logits.device)
    arg = torch.empty(n * splits, dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(n * splits,)](
        logits,
        bitmask,
        indices,
        val,
        arg,
        *common,
        HAS_INDICES=indices is not None,
        FINAL=False,
        WORDS=WORDS_PER_BLOCK,
        num_warps=NUM_WARPS,
    )
    _argmax_combine_kernel[(n,)](val, arg, out, splits, SPLITS=triton.next_power_of_2(splits))
    return out


def masked_softmax_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    log: bool = False,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """CUDA path of :func:`spec_grammar.kernels.masked_softmax` (inputs checked by the caller)."""
    n = bitmask.shape[0]
    vocab = logits.shape[1]
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n == 0 or vocab == 0:
        return out
    splits, words = _splits(n, vocab)
    part_m = torch.empty(n * splits, dtype=torch.float32, device=logits.device)
    part_s = torch.empty(n * splits, dtype=torch.float32, device=logits.device)
    t_tensor = isinstance(temperature, torch.Tensor)
    t_ptr = temperature if t_tensor else None
    t_val = 1.0 if t_tensor else float(temperature)
    geometry = (vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0))
    flags = dict(
        HAS_INDICES=indices is not None,
        HAS_T_TENSOR=t_tensor,
        WORDS=WORDS_PER_BLOCK,
        num_warps=NUM_WARPS,
    )
    _softmax_partial_kernel[(n * splits,)](
        logits, bitmask, indices, t_ptr, part_m, part_s, t_val, *geometry, splits, words, **flags
    )
    _softmax_write_kernel[(n * splits,)](
        logits,
        bitmask,
        indices,
        t_ptr,
        part_m,
        part_s,
        out,
        t_val,
        *geometry,
        out.stride(0),
        splits,
        words,
        LOG=log,
        SPLITS=triton.next_power_of_2(splits),
        **flags,
    )
    return out
