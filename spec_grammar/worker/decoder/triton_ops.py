"""Triton kernels of the fused decoder forward (CUDA; safe inside CUDA graphs).

Each replaces a chain of small PyTorch kernels that Hugging Face's Llama layers launch one by
one: RMSNorm with its residual add (HF: ~8 kernels), rotary embedding of q and k plus the KV
cache write (HF: ~14 kernels and two ``index_put``), SiLU times the up projection (HF: 2).
Rounding follows the HF modules: the residual sum is rounded to the model dtype, the norm is
computed in float32 and rounded before the weight multiply, each rotary product is rounded
before the sum. cos/sin come from torch (:func:`.ops.rotary_cos_sin`, once per forward):
Triton's ``tl.cos`` may lower to the approximate hardware instruction, which loses accuracy
for the large angles of late positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, hidden, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0)
    if HAS_RES:
        x = x.to(tl.float32) + tl.load(res_ptr + row * hidden + cols, mask=ok, other=0.0).to(
            tl.float32
        )
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_ptr + row * hidden + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(
        out_ptr + row * hidden + cols,
        (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=ok,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """See :func:`spec_grammar.worker.decoder.ops.rms_norm` (contiguous ``(T, H)`` CUDA tensors)."""
    t, hidden = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(t,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        hidden,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    row_ptr,
    wpos_ptr,
    n,
    heads,
    kv_heads,
    k_s0,
    k_s1,
    k_s2,
    v_s0,
    v_s1,
    v_s2,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # b * n + i
    head = tl.program_id(1)
    b = tok // n
    i = tok % n
    dim = 2 * HALF
    width = (heads + 2 * kv_heads) * dim
    d = tl.arange(0, BLOCK)  # BLOCK: HALF rounded up to a power of two (tl.arange needs one)
    ok = d < HALF
    dt = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + tok * HALF + d, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * HALF + d, mask=ok, other=0.0).to(tl.float32)
    src = qkv_ptr + tok * width + head * dim
    x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
    # rounded like HF's q * cos + rotate_half(q) * sin: each product, then the sum
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    if head < heads:
        dst = q_ptr + ((b * heads + head) * n + i) * dim
        tl.store(dst + d, o1, mask=ok)
        tl.store(dst + HALF + d, o2, mask=ok)
    else:
        kh = head - heads
        row = tl.load(row_ptr + b).to(tl.int64)
        wp = tl.load(wpos_ptr + tok).to(tl.int64)
        kdst = k_ptr + row * k_s0 + kh * k_s1 + wp * k_s2
        tl.store(kdst + d, o1, mask=ok)
        tl.store(kdst + HALF + d, o2, mask=ok)
        vsrc = qkv_ptr + tok * width + (heads + kv_heads + kh) * dim
        vdst = v_ptr + row * v_s0 + kh * v_s1 + wp * v_s2
        tl.store(vdst + d, tl.load(vsrc + d, mask=ok), mask=ok)
        tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d, mask=ok), mask=ok)


def rope_and_cache(
    qkv, cos, sin, k_buf, v_buf, row_idx, write_pos, b, n, heads, kv_heads, head_dim
):
    """See :func:`spec_grammar.worker.decoder.ops.rope_and_cache`."""
    q = torch.empty(b, heads, n, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(b * n, heads + kv_heads)](
        qkv,
        cos,
        sin,
        q,
        k_buf,
        v_buf,
        row_idx,
        write_pos,
        n,
        heads,
        kv_heads,
        k_buf.stride(0),
        k_buf.stride(1),
        k_buf.stride(2),
        v_buf.stride(0),
        v_buf.stride(1),
        v_buf.stride(2),
        HALF=head_dim // 2,
        BLOCK=triton.next_power_of_2(head_dim // 2),
        num_warps=1,
    )
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(dt), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`spec_grammar.worker.decoder.ops.silu_mul`."""
    t, width = gate_up.shape
    inter = width // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
