"""Small-batch float32 projections on CPU: ``cpu_gemm.cpp``, built on first use.

A verify forward of a few tokens on a CPU is bound by streaming the weights from memory once;
oneDNN's matmul, tuned for large batches, reaches about half the memory bandwidth at one row
and a third at 8 (SmolLM2-135M's LM head on one core of this project's AMD EPYC: 8.3 ms at 1
row, 15 ms at 8; the kernel here: 5.5 ms and 7 ms; the source says how). It runs for up to
:data:`MAX_ROWS` rows, where it measured faster; more rows go to oneDNN.

The library is compiled from the packaged source with the system's C++ compiler (``$CXX``, which
may carry arguments such as ``ccache g++``; unset or empty: ``g++``) with ``-O3 -march=native
-fopenmp`` (about a second) into ``<cache>/kernels/cpu_gemm-<hash>.so``
(:func:`spec_grammar.models.cache_dir`), keyed by the source, the flags, the compiler and the
CPU, and loaded with :mod:`ctypes` (the call releases the GIL). Without an x86-64 CPU with
AVX-512, without a compiler, when the build fails, or with ``SPEC_GRAMMAR_CPU_GEMM=0`` (or
``false`` / ``off`` / ``no``), :func:`linear` returns None and the caller keeps oneDNN;
:func:`status` says why, and the reason is logged once (at WARNING where the user can act: no
compiler, a failed build).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["MAX_ROWS", "available", "linear", "status"]

log = logging.getLogger(__name__)

MAX_ROWS = 24
"""Most rows :func:`linear` takes: up to 24 it measured faster than oneDNN on SmolLM2's
projections (1.2-2.4x from 1 to 16 rows, 1.1-1.2x at 24), at 32 even."""

_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data_ptr is their memory
_OFF = ("0", "false", "off", "no")  # SPEC_GRAMMAR_CPU_GEMM values that turn the kernel off
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_flags() -> str:
    """The CPU's model name and feature flags (``/proc/cpuinfo``; empty where unreadable)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    lines = info.splitlines()
    pick = [next((ln for ln in lines if ln.startswith(k)), "") for k in ("model name", "flags")]
    return "\n".join(pick)


def _whole_elf(path: Path | str) -> bool:
    """Whether ``path`` is a 64-bit little-endian ELF file holding every byte its headers point
    at. ``dlopen`` of a file cut short (a crash before it reached the disk) dies with SIGBUS
    rather than failing, so a cached library is checked before it is loaded (the layout:
    the System V ABI's ELF-64 header and program headers)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if len(data) < 64 or data[:6] != b"\x7fELF\x02\x01":
        return False
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    if phentsize < 56 or phoff + phnum * phentsize > len(data):  # 56: an ELF-64 program header
        return False
    if shoff + shnum * shentsize > len(data):
        return False
    for i in range(phnum):
        offset, _, _, filesz = struct.unpack_from("<QQQQ", data, phoff + i * phentsize + 8)
        if offset + filesz > len(data):
            return False
    return True


def _build(cxx: list[str], cpu: str) -> Path:
    """The compiled library for the compiler command ``cxx`` (the executable and its arguments)
    on this CPU (built now unless cached). The cache key holds the command, its version and the
    CPU's flags: ``-march=native`` code built on one CPU may not run on another that
    shares the cache directory. Raises OSError / subprocess.CalledProcessError when the build
    fails. A cached file that is not a whole ELF library is built again."""
    from ...models import cache_dir

    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join([_SOURCE.read_text(), " ".join([*cxx, *_FLAGS]), version, cpu]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"cpu_gemm-{key}.so"
    if _whole_elf(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes building at once never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*cxx, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, text=True
        )
        if not _whole_elf(tmp):
            raise OSError(f"{' '.join(cxx)} exited 0 but wrote no ELF library")
        # on disk before the rename: a crash must not leave a short file under the final name
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _load():
    """``(ctypes function, None)`` or ``(None, why not)``; the reason logged once: at WARNING
    where the user can act (no compiler, a failed build: decoding then runs about 1.5-2x slower
    on such a CPU), else INFO."""
    switch = os.environ.get("SPEC_GRAMMAR_CPU_GEMM", "1")
    if switch.strip().lower() in _OFF:
        why = f"off (SPEC_GRAMMAR_CPU_GEMM={switch})"
        log.info("small-batch CPU kernel %s: oneDNN projections", why)
        return None, why
    cpu = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or " avx512f" not in cpu:
        why = "needs an x86-64 CPU with AVX-512"
        log.info("small-batch CPU kernel %s: oneDNN projections", why)
        return None, why
    # make's reading of $CXX: empty means the default, and it may carry arguments (ccache g++)
    cxx = shlex.split(os.environ.get("CXX") or "g++") or ["g++"]
    exe = shutil.which(cxx[0])
    if exe is None:
        why = f"needs a C++ compiler ({cxx[0]} not found; set $CXX)"
        log.warning(
            "small-batch CPU kernel %s: oneDNN projections, decoding about 1.5-2x slower on "
            "this CPU; install g++ to build it",
            why,
        )
        return None, why
    cxx = [exe, *cxx[1:]]
    try:
        path = _build(cxx, cpu)
        try:
            fn = ctypes.CDLL(str(path)).sg_linear_f32
        except (OSError, AttributeError):  # a cached file that is not this library: build anew
            path.unlink(missing_ok=True)
            fn = ctypes.CDLL(str(_build(cxx, cpu))).sg_linear_f32
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        why = f"did not build with {' '.join(cxx)}"
        log.warning("small-batch CPU kernel %s: oneDNN projections (%s)", why, detail[:500])
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
