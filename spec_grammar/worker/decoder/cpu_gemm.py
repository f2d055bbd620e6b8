"""Small-batch float32 projections on CPU: ``cpu_gemm.cpp``, built on first use.

A verify forward of a few tokens on a CPU is bound by streaming the weights from memory once;
oneDNN's matmul, tuned for large batches, reaches about half the memory bandwidth at one row
and a third at 8 (SmolLM2-135M's LM head on one core of this project's AMD EPYC: 8.3 ms at 1
row, 15 ms at 8; the kernel here: 5.5 ms and 7 ms; the source says how). It runs for up to
:data:`MAX_ROWS` rows, where it measured faster; more rows go to oneDNN.

Built and loaded by :mod:`.native` (``g++ -O3 -march=native -fopenmp``, cached under
``<cache>/kernels``). Without an x86-64 CPU with AVX-512, without a compiler, when the build
fails, or with ``SPEC_GRAMMAR_CPU_GEMM=0`` (or ``false`` / ``off`` / ``no``), :func:`linear`
returns None and the caller keeps oneDNN; :func:`status` says why, and the reason is logged
once (at WARNING where the user can act: no compiler, a failed build).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import native

__all__ = ["MAX_ROWS", "available", "linear", "status"]

MAX_ROWS = 24
"""Most rows :func:`linear` takes: up to 24 it measured faster than oneDNN on SmolLM2's
projections (1.2-2.4x from 1 to 16 rows, 1.1-1.2x at 24), at 32 even."""

_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data_ptr is their memory


@functools.cache
def _load():
    """``(ctypes function, None)`` or ``(None, why not)``; the reason logged once: at WARNING
    where the user can act (no compiler, a failed build: decoding then runs about 1.5-2x slower
    on such a CPU), else INFO."""
    fn, why = native.load(
        _SOURCE,
        "sg_linear_f32",
        "SPEC_GRAMMAR_CPU_GEMM",
        "small-batch CPU kernel",
        "oneDNN projections",
        "decoding about 1.5-2x slower on this CPU",
    )
    if fn is None:
        return None, why
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
    fn.restype = None
    return fn, None


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _load()[0] is not None


def status() -> str:
    """``"on"``, or why the kernel does not run (e.g. ``"needs an x86-64 CPU with AVX-512"``);
    builds it on the first call."""
    return _load()[1] or "on"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for float32 strided CPU tensors ``x (T, in)`` (unit column
    stride), ``weight (out, in)`` contiguous, ``bias (out,)`` or None, ``1 <= T <=``
    :data:`MAX_ROWS`; returns ``(T, out)`` float32, or None where the kernel does not apply
    (other shapes, dtypes, devices or layouts, negated views, an input needing a gradient,
    tensor subclasses or an active dispatch mode, or the kernel unavailable): the caller
    computes it another way. Runs on ``torch.get_num_threads()`` threads."""
    if not (
        # real memory only: a tensor subclass (FakeTensor, FunctionalTensor) or a tensor made
        # under a dispatch mode (FakeTensorMode) may have no data behind its pointer
        all(type(t) in _PLAIN for t in (x, weight, bias) if t is not None)
        and _get_current_dispatch_mode() is None
        and x.layout == weight.layout == torch.strided
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] == x.shape[1]
        and (
            bias is None
            or (
                bias.dtype == torch.float32
                and bias.device.type == "cpu"
                and bias.shape == (weight.shape[0],)
            )
        )
        # the kernel reads raw storage: a negated view's sign bit would be ignored
        and not any(t.is_neg() for t in (x, weight, bias) if t is not None)
        and not (
            torch.is_grad_enabled()
            and any(t.requires_grad for t in (x, weight, bias) if t is not None)
        )
    ):
        return None
    fn = _load()[0]
    if fn is None:
        return None
    if bias is not None:
        bias = bias.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    fn(
        x.data_ptr(),
        m,
        x.stride(0),
        weight.data_ptr(),
        n,
        k,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return y
