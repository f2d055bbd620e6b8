"""The fused decoder's operations: its projection GEMM, and three non-GEMM operations with a
torch reference each and a Triton kernel each on CUDA.

The torch versions compute exactly what Hugging Face's Llama modules compute (same operations in
the same dtypes), so on CPU the fused forward matches the HF forward; the Triton versions
(:mod:`.triton_ops`) round the same way in one kernel each and are checked against these.

:func:`linear` runs CPU projections through oneDNN instead of ``F.linear``'s MKL ``sgemm``: over
SmolLM2-135M's 30 layers on an AVX-512 host (one thread, float32) the two were on par from 4 rows
up and oneDNN 1.35x faster at 2 rows (38 vs 51 ms), where MKL's time jumps; the model's own dense
weights are used (no packed copy: ``benchmarks/bench_cpu_forward.py``,
``benchmarks/results/cpu-forward.md``). Up to a few dozen float32 rows (a verify forward of a
few tokens) it runs :mod:`.cpu_gemm`'s kernel instead, which streams the weights at close to the
memory's bandwidth where oneDNN reaches half of it or less.
"""

from __future__ import annotations

import torch

from . import cpu_gemm

try:
    from . import triton_ops
except ImportError:  # torch without Triton (CPU wheels)
    triton_ops = None

__all__ = [
    "linear",
    "rms_norm",
    "rope_and_cache",
    "rope_and_cache_rows",
    "rotary_cos_sin",
    "silu_mul",
    "use_triton",
]

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t``'s operations run as Triton kernels: a CUDA tensor of a half or single
    precision dtype, and Triton present (the kernels compute in float32, so float64 models run
    the torch versions and keep their precision)."""
    return (
        t.is_cuda
        and triton_ops is not None
        and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def _onednn_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN's matmul computes ``F.linear(x, weight, bias)``: one dtype and CPU for all
    three, and a bias of ``(out,)``. Otherwise its op fails with an opaque "could not create a
    primitive descriptor" or, for a bias without storage, reads no bias at all; ``F.linear``
    names the mismatch instead."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and (
            bias is None
            or (
                bias.device.type == "cpu"
                and bias.dtype == x.dtype
                and bias.shape == (weight.shape[0],)
            )
        )
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``) for ``x (T, in)`` and ``weight (out, in)`` of one
    dtype; returns ``(T, out)``. On CPU in float32 up to :data:`.cpu_gemm.MAX_ROWS` rows it runs
    the small-batch kernel (:mod:`.cpu_gemm`) where it is available; otherwise on CPU in float32
    / bfloat16 with oneDNN present oneDNN's matmul (see the module docstring); elsewhere (CUDA,
    float64, or an input that needs a gradient) ``F.linear``."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= cpu_gemm.MAX_ROWS:
        y = cpu_gemm.linear(x, weight, bias)
        if y is not None:
            return y
    if (
        _onednn_linear is not None
        and x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and _onednn_takes(x, weight, bias)
        # the oneDNN op has no autograd formula: an input needing a gradient goes to F.linear
        and not (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (x, weight, bias))
        )
    ):
        return _onednn_linear(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x``, or of ``residual + x`` when ``residual`` is given.

    Args:
        x: ``(T, H)`` contiguous, model dtype.
        weight: ``(H,)`` norm weight; eps: the variance epsilon.
        residual: ``(T, H)`` residual stream, updated in place to ``residual + x`` (rounded to
            the model dtype, as HF's ``residual + hidden_states``).

    Returns the normalized ``(T, H)`` tensor: ``weight * (s * rsqrt(mean(s^2) + eps))`` with the
    norm in float32 and rounded to the model dtype before the weight multiply (HF's LlamaRMSNorm).
    """
    if use_triton(x):
        return triton_ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
):
    """cos and sin ``(T, D / 2)`` in ``dtype`` of ``positions (T,)`` long: the angles in float32
    (``position * inv_freq``, ``inv_freq (D / 2,)`` float32), times the rotary attention
    ``scaling``, rounded to ``dtype``, exactly as HF's rotary embedding computes them."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    row_idx: torch.Tensor,
    write_pos: torch.Tensor,
    b: int,
    n: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Rotary embedding of q and k (rotate-half layout, as HF's ``apply_rotary_pos_emb``), and
    the KV cache write.

    Args:
        qkv: ``(b * n, (heads + 2 * kv_heads) * head_dim)`` output of the merged QKV projection.
        cos, sin: ``(b * n, head_dim // 2)`` from :func:`rotary_cos_sin`, model dtype.
        k_buf, v_buf: ``(rows, kv_heads, capacity, head_dim)`` cache buffers (any strides with a
            contiguous last dim): the rotated k and the v of token ``(i, j)`` are written at
            ``[row_idx[i], :, write_pos[i, j]]``.
        row_idx: ``(b,)`` long; write_pos: ``(b, n)`` long.

    Returns the rotated queries ``(b, heads, n, head_dim)``, contiguous.
    """
    if use_triton(qkv):
        return triton_ops.rope_and_cache(
            qkv,
            cos,
            sin,
            k_buf,
            v_buf,
            row_idx,
            write_pos.reshape(-1),
            b,
            n,
            heads,
            kv_heads,
            head_dim,
        )
    flat_rows = row_idx[:, None].expand(b, n).reshape(-1)
    q = rope_and_cache_rows(
        qkv, cos, sin, k_buf, v_buf, flat_rows, write_pos.reshape(-1), heads, kv_heads, head_dim
    )
    return q.view(b, n, heads, head_dim).transpose(1, 2).contiguous()


def rope_and_cache_rows(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: torch.Tensor,
    write_pos: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """:func:`rope_and_cache` over ``T`` tokens in any order (torch operations): token ``t``'s
    rotated k and its v are written at ``[rows[t], :, write_pos[t]]``; ``rows``, ``write_pos``
    ``(T,)`` long, ``qkv (T, ...)``, ``cos``, ``sin (T, head_dim // 2)``. Returns the rotated
    queries ``(T, heads, head_dim)``."""
    x = qkv.view(-1, heads + 2 * kv_heads, head_dim)
    rot = x[:, : heads + kv_heads]
    half = head_dim // 2
    x1, x2 = rot[..., :half], rot[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # (T, heads + kv_heads, D)
    # two advanced indices around a sliced head dim: the indexed result is (T, kv_heads, D)
    k_buf[rows, :, write_pos] = rotated[:, heads:]
    v_buf[rows, :, write_pos] = x[:, heads + kv_heads :]
    return rotated[:, :heads]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the merged gate/up projection ``(T, 2 * I)`` (gate first), as
    HF's ``act_fn(gate_proj(x)) * up_proj(x)``. Returns ``(T, I)``."""
    if use_triton(gate_up):
        return triton_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
