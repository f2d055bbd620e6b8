"""Build and load the decoder's C++ CPU kernels (:mod:`.cpu_gemm`, :mod:`.cpu_attention`).

Each kernel is one packaged ``.cpp`` file compiled on first use with the system's C++ compiler
(``$CXX``, which may carry arguments such as ``ccache g++``; unset or empty: ``g++``) with
``-O3 -march=native -fopenmp`` (about a second) into ``<cache>/kernels/<name>-<hash>.so``
(:func:`spec_grammar.models.cache_dir`), keyed by the source, the flags, the compiler and the
CPU, and loaded with :mod:`ctypes` (a call releases the GIL). Without an x86-64 CPU with
AVX-512, without a compiler, when the build fails, or with the kernel's switch variable set to
``0`` (or ``false`` / ``off`` / ``no``), :func:`load` returns the reason instead of a
function, logged once (at WARNING where the user can act: no compiler, a failed build).
"""

from __future__ import annotations

import ctypes
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

__all__ = ["load"]

log = logging.getLogger(__name__)

_OFF = ("0", "false", "off", "no")  # switch values that turn a kernel off
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


def _build(source: Path, cxx: list[str], cpu: str) -> Path:
    """The library compiled from ``source`` by the compiler command ``cxx`` (the executable and
    its arguments) on this CPU (built now unless cached). The cache key holds the source, the
    command, its version and the CPU's flags: ``-march=native`` code built on one CPU may not
    run on another that shares the cache directory. Raises OSError /
    subprocess.CalledProcessError when the build fails. A cached file that is not a whole ELF
    library is built again."""
    from ...models import cache_dir

    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join([source.read_text(), " ".join([*cxx, *_FLAGS]), version, cpu]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if _whole_elf(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes building at once never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*cxx, *_FLAGS, str(source), "-o", tmp], check=True, capture_output=True, text=True
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


def load(source: Path, symbol: str, switch: str, what: str, fallback: str, slower: str):
    """``(ctypes function, None)`` for ``symbol`` of the library built from ``source``, or
    ``(None, why not)``.

    Args:
        source: the kernel's ``.cpp`` file; symbol: its ``extern "C"`` function.
        switch: the environment variable that turns the kernel off (``0`` / false / off / no).
        what, fallback: the log's words for the kernel and what runs without it
            (``"small-batch CPU kernel"``, ``"oneDNN projections"``).
        slower: what a user loses without it, in the warning for a missing compiler or a
            failed build (``"decoding about 1.5-2x slower on this CPU"``).

    The reason is logged here (once per caller: cache the result); the caller sets the
    function's ``argtypes``.
    """
    value = os.environ.get(switch, "1")
    if value.strip().lower() in _OFF:
        why = f"off ({switch}={value})"
        log.info("%s %s: %s", what, why, fallback)
        return None, why
    cpu = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or " avx512f" not in cpu:
        why = "needs an x86-64 CPU with AVX-512"
        log.info("%s %s: %s", what, why, fallback)
        return None, why
    # make's reading of $CXX: empty means the default, and it may carry arguments (ccache g++)
    cxx = shlex.split(os.environ.get("CXX") or "g++") or ["g++"]
    exe = shutil.which(cxx[0])
    if exe is None:
        why = f"needs a C++ compiler ({cxx[0]} not found; set $CXX)"
        log.warning("%s %s: %s, %s; install g++ to build it", what, why, fallback, slower)
        return None, why
    cxx = [exe, *cxx[1:]]
    try:
        path = _build(source, cxx, cpu)
        try:
            fn = getattr(ctypes.CDLL(str(path)), symbol)
        except (OSError, AttributeError):  # a cached file that is not this library: build anew
            path.unlink(missing_ok=True)
            fn = getattr(ctypes.CDLL(str(_build(source, cxx, cpu))), symbol)
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        why = f"did not build with {' '.join(cxx)}"
        log.warning("%s %s: %s, %s (%s)", what, why, fallback, slower, detail[:500])
        return None, why
    return fn, None
