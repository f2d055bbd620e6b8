"""Attention of a few query tokens per request on CPU: ``cpu_attention.cpp``, built on first use.

A decode or draft-tree verify step attends a few queries per request to a few hundred cached
keys. ``F.scaled_dot_product_attention`` over ``k_buf[rows, :, :kv_len]`` gathers the rows
first (a copy when ``rows`` is an index tensor) and ran at about a quarter of the memory
bandwidth (SmolLM2-135M, 8 requests x 1 token over 300 keys, one thread: 479 us a layer where
reading its keys and values takes 132 us). The kernel reads each request's keys and values in
place in the runner's store, once per (request, KV head) for all the query heads of its group
and all its query tokens, one task per (request, KV head) on ``torch.get_num_threads()``
OpenMP threads; the source says how.

Built and loaded by :mod:`.native` (``g++ -O3 -march=native -fopenmp``, cached under
``<cache>/kernels``). Without an x86-64 CPU with AVX-512, without a compiler, when the build
fails, or with ``SPEC_GRAMMAR_CPU_ATTENTION=0`` (or ``false`` / ``off`` / ``no``),
:func:`attention` returns None and the caller keeps SDPA; :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import native

__all__ = ["MAX_QUERIES", "attention", "available", "status"]

MAX_QUERIES = 32
"""Most query tokens per request :func:`attention` takes (a decode step has 1, a draft-tree
verify up to a few dozen); more go to SDPA."""

_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data_ptr is their memory


@functools.cache
def _load():
    """``(ctypes function, None)`` or ``(None, why not)``; the reason logged once."""
    fn, why = native.load(
        _SOURCE,
        "sg_attention_f32",
        "SPEC_GRAMMAR_CPU_ATTENTION",
        "small-batch CPU attention kernel",
        "SDPA attention",
        "attention about 3x slower on this CPU",
    )
    if fn is None:
        return None, why
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        *(ptr, i64, i64, i64, i64, i64),  # q, B, KH, G, n, D
        *(ptr, ptr, ptr, i64),  # k, v, rows, the store's row count
        *(i64, i64, i64),  # row / head / position strides
        *(ptr, i64, i64, i64, ctypes.c_float),  # mask, its batch / row strides, kv, scale
        *(ptr, ptr, ctypes.c_int),  # queries, out, threads
    ]
    fn.restype = ctypes.c_int
    return fn, None


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _load()[0] is not None


def status() -> str:
    """``"on"``, or why the kernel does not run; builds it on the first call."""
    return _load()[1] or "on"


def row_indices(rows: slice | torch.Tensor, capacity: int) -> torch.Tensor | None:
    """``rows`` (a slice, or a 1-D long CPU tensor, of the store's ``capacity`` rows) as a
    contiguous int64 tensor of row indices, or None where they are not all within
    ``[0, capacity)`` (the kernel would read outside the store; indexing raises there)."""
    if isinstance(rows, slice):
        start, stop, step = rows.indices(capacity)
        return torch.arange(start, stop, step, dtype=torch.long)
    if not (
        type(rows) in _PLAIN
        and rows.dtype == torch.long
        and rows.is_cpu
        and rows.dim() == 1
        and rows.numel() > 0
    ):
        return None
    low, high = rows.aminmax()
    if int(low) < 0 or int(high) >= capacity:
        return None
    return rows.contiguous()


def attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: torch.Tensor,
    kv_len: int,
    mask: torch.Tensor,
    scale: float,
    queries: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Grouped-query attention of ``b`` requests' ``n`` query tokens over the store's first
    ``kv_len`` positions of their rows, float32 on CPU, without copying the keys or values.

    Args:
        q: ``(b, heads, n, D)`` contiguous queries (rotated), ``heads`` a multiple of
            ``kv_heads``; ``D`` a multiple of 16 up to 128; ``1 <= n <=`` :data:`MAX_QUERIES`.
        k_buf, v_buf: the store's ``(capacity_rows, kv_heads, capacity, D)`` buffers, the same
            strides, unit stride along ``D``; ``kv_len <= capacity``.
        rows: ``(b,)`` int64 contiguous row indices, each in ``[0, capacity_rows)``
            (:func:`row_indices` makes them).
        mask: ``(b, 1, n, kv_len)`` additive mask (0 or a large negative), unit last stride,
            shared by every head (not repeated per group).
        scale: the score scale (``1 / sqrt(D)`` for Llama).
        queries: ``(b,)`` int64 contiguous, how many leading query tokens of each request to
            compute (``0 <= queries[i] <= n``; the others are padding, their output zero), or
            None for all ``n``.

    Returns ``(b, n, heads, D)`` float32 contiguous (``softmax(scale * q k^T + mask) v`` per
    head, query head ``h`` on KV head ``h // (heads / kv_heads)``), or None where the kernel does
    not apply (other dtypes, devices, shapes or layouts, negated views, tensor subclasses or an
    active dispatch mode, an input needing a gradient, or the kernel unavailable): the caller
    runs SDPA. Runs on ``torch.get_num_threads()`` threads.

    Raises:
        IndexError: a row index outside the store.
        ValueError: a ``queries`` entry outside ``[0, n]``.
    """
    tensors = (q, k_buf, v_buf, rows, mask) + ((queries,) if queries is not None else ())
    if not (
        # real memory only: a tensor subclass or a tensor under a dispatch mode may have no data
        all(type(t) in _PLAIN for t in tensors)
        and _get_current_dispatch_mode() is None
        # (is_cpu: a twentieth of device.type's cost; this runs once per layer)
        and all(t.is_cpu and t.layout == torch.strided for t in tensors)
        and q.dtype == k_buf.dtype == v_buf.dtype == mask.dtype == torch.float32
        and q.dim() == 4
        and q.is_contiguous()
        and k_buf.dim() == 4
        and k_buf.shape == v_buf.shape
        and k_buf.stride() == v_buf.stride()
        and k_buf.stride(3) == 1
        and not any(t.is_neg() for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    ):
        return None
    b, heads, n, d = q.shape
    kv_heads = k_buf.shape[1]
    if not (
        1 <= n <= MAX_QUERIES
        and d % 16 == 0
        and 16 <= d <= 128
        and k_buf.shape[3] == d
        and heads % kv_heads == 0
        and 1 <= kv_len <= k_buf.shape[2]
        and mask.shape == (b, 1, n, kv_len)
        and mask.stride(3) == 1
        and rows.dtype == torch.long
        and rows.shape == (b,)
        and rows.is_contiguous()
        and (
            queries is None
            or (queries.dtype == torch.long and queries.shape == (b,) and queries.is_contiguous())
        )
    ):
        return None
    fn = _load()[0]
    if fn is None:
        return None
    out = torch.empty(b, n, heads, d, dtype=torch.float32)
    # the kernel checks the indices before any work: one pass over b integers in C++, where
    # an aminmax here would cost a few us per layer
    error = fn(
        q.data_ptr(),
        b,
        kv_heads,
        heads // kv_heads,
        n,
        d,
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        rows.data_ptr(),
        k_buf.shape[0],
        k_buf.stride(0),
        k_buf.stride(1),
        k_buf.stride(2),
        mask.data_ptr(),
        mask.stride(0),
        mask.stride(2),
        kv_len,
        scale,
        None if queries is None else queries.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if error == 1:
        raise IndexError(f"cpu_attention: a row index is outside the store's {k_buf.shape[0]} rows")
    if error == 2:
        raise ValueError(f"cpu_attention: a queries entry is outside [0, {n}]")
    return out
