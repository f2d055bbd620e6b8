"""The small-batch CPU projection kernel (:mod:`spec_grammar.worker.decoder.cpu_gemm`): against
float64 ``F.linear``, row results independent of the batch, the shapes it declines, and the
fallback to oneDNN when it cannot be built."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_grammar.worker.decoder import cpu_gemm, ops

pytestmark = pytest.mark.integration  # builds the C++ projection kernel

needs_kernel = pytest.mark.skipif(
    not cpu_gemm.available(), reason="no AVX-512 CPU or no C++ compiler here"
)


def _run_fresh(code: str, cache=None, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (the kernel's load is cached per process), with ``env``
    added and ``SPEC_GRAMMAR_CACHE`` set to ``cache`` when given."""
    run_env = {**os.environ, **env}
    if cache is not None:
        run_env["SPEC_GRAMMAR_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120
    )


def _reference(x, w, b):
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_linear_on_odd_shapes(threads):
    """Rows 1..MAX_ROWS, inner sizes with and without a 16-wide tail, output sizes not a
    multiple of the kernel's row blocks, strided inputs, with and without bias: within float32
    rounding of the float64 product (error bound ~ K * eps * sum |x w|)."""
    torch.manual_seed(0)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 5, 8, 9, 16, 17, cpu_gemm.MAX_ROWS):
            for k, n in ((576, 1536), (17, 7), (100, 65), (1536, 129), (16, 1), (33, 1000)):
                wide = torch.randn(m, k + 5)
                x = wide[:, :k]  # row stride k + 5
                w, b = torch.randn(n, k), torch.randn(n)
                for bias in (None, b):
                    got = cpu_gemm.linear(x, w, bias)
                    assert got is not None and got.shape == (m, n) and got.dtype == torch.float32
                    want = _reference(x, w, bias)
                    scale = _reference(x.abs(), w.abs(), None if bias is None else bias.abs())
                    err = (got.double() - want).abs() / (scale * k * 1.2e-7 + 1e-30)
                    assert err.max() <= 1.0, (m, k, n, bias is None)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_batch():
    """Each output row is computed the same way whatever the other rows are (a request's
    logits do not move with the batch's other requests): bitwise equal alone and in batches."""
    torch.manual_seed(1)
    w, b = torch.randn(1000, 576), torch.randn(1000)
    x = torch.randn(cpu_gemm.MAX_ROWS, 576)
    full = cpu_gemm.linear(x, w, b)
    for m in range(1, cpu_gemm.MAX_ROWS + 1):
        assert torch.equal(cpu_gemm.linear(x[:m], w, b), full[:m])
    for i in (0, 7, 8, 23):
        assert torch.equal(cpu_gemm.linear(x[i : i + 1], w, b), full[i : i + 1])


def test_kernel_declines_what_it_does_not_compute_and_ops_linear_still_does():
    """float64, bfloat16, more rows than MAX_ROWS, a transposed weight, a column-strided input,
    a mismatched inner size: :func:`cpu_gemm.linear` returns None and :func:`ops.linear` gives
    ``F.linear``'s result another way."""
    torch.manual_seed(2)
    w = torch.randn(64, 32)
    cases = [
        (torch.randn(3, 32, dtype=torch.float64), w.double()),
        (torch.randn(3, 32, dtype=torch.bfloat16), w.bfloat16()),
        (torch.randn(cpu_gemm.MAX_ROWS + 1, 32), w),
        (torch.randn(3, 32), torch.randn(32, 64).t()),
        (torch.randn(32, 3).t(), w),
    ]
    for x, weight in cases:
        assert cpu_gemm.linear(x, weight, None) is None
        want = torch.nn.functional.linear(x.double(), weight.double())
        tol = 5e-2 if x.dtype == torch.bfloat16 else 1e-4
        assert torch.allclose(ops.linear(x, weight, None).double(), want, atol=tol, rtol=tol)
    assert cpu_gemm.linear(torch.randn(3, 31), w, None) is None


@pytest.mark.parametrize(
    "env, reason",
    [({"SPEC_GRAMMAR_CPU_GEMM": "0"}, "SPEC_GRAMMAR_CPU_GEMM=0"), ({"CXX": "false"}, "build")],
)
def test_without_the_kernel_projections_fall_back_to_onednn(tmp_path, env, reason):
    """Turned off, or with a compiler that fails (``CXX=false``, a fresh cache): the kernel is
    unavailable, the reason is logged, and ``ops.linear`` still computes the product."""
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from spec_grammar.worker.decoder import cpu_gemm, ops\n"
        "x, w = torch.randn(4, 40), torch.randn(24, 40)\n"
        "assert not cpu_gemm.available()\n"
        "want = torch.nn.functional.linear(x.double(), w.double())\n"
        "assert torch.allclose(ops.linear(x, w, None).double(), want, atol=1e-4)\n"
    )
    out = _run_fresh(code, tmp_path, **env)
    assert out.returncode == 0, out.stderr
    if reason == "build" and not cpu_gemm.available():
        pytest.skip("no AVX-512 CPU here: the build is never tried")
    assert ("SPEC_GRAMMAR_CPU_GEMM=0" if reason != "build" else "did not build") in out.stderr


@needs_kernel
def test_inputs_the_kernel_cannot_honour_go_to_torch():
    """A bias that needs a gradient, a bias on another device, a negated view (``is_neg``), a
    weight without strided storage: the kernel would drop the gradient, read a null or foreign
    pointer, ignore the sign bit, or fail on ``data_ptr``; :func:`cpu_gemm.linear` declines them
    and :func:`ops.linear` behaves as ``F.linear`` does (same values, gradient, or error)."""
    torch.manual_seed(3)
    x, w, b = torch.randn(3, 40), torch.randn(7, 40), torch.randn(7)

    bias = b.clone().requires_grad_()
    assert cpu_gemm.linear(x, w, bias) is None
    ops.linear(x, w, bias).sum().backward()
    assert torch.allclose(bias.grad, torch.full((7,), 3.0))

    assert cpu_gemm.linear(x, w, torch.empty(7, device="meta")) is None
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(x, w, torch.empty(7, device="meta"))
    with pytest.raises(RuntimeError):
        ops.linear(x, w, torch.empty(7, device="meta"))

    want = torch.nn.functional.linear(-x.double(), -w.double(), -b.double())
    neg = torch._neg_view
    for args in ((neg(x), -w, -b), (-x, neg(w), -b), (-x, -w, neg(b))):
        got = ops.linear(*args)
        assert torch.allclose(got.double(), want, atol=1e-4), [a.is_neg() for a in args]

    if torch.backends.mkldnn.is_available():
        assert cpu_gemm.linear(x, w.to_mkldnn(), None) is None


def _probe(cache, **env):
    """``cpu_gemm.available()`` in a fresh process on ``cache``: (returncode, stdout+stderr)."""
    code = (
        "import logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from spec_grammar.worker.decoder import cpu_gemm\n"
        "print('available', cpu_gemm.available())\n"
    )
    out = _run_fresh(code, cache, **env)
    return out.returncode, out.stdout + out.stderr


@needs_kernel
def test_a_corrupt_cached_library_is_rebuilt_not_loaded(tmp_path):
    """A cached library cut short (a crash before the file reached the disk) made ``dlopen``
    die with SIGBUS; one of another build lacked the symbol (AttributeError). Both are now
    rebuilt, and the rebuilt file equals a clean build."""
    rc, out = _probe(tmp_path)
    assert rc == 0 and "available True" in out, out[-500:]
    (lib,) = (tmp_path / "kernels").glob("cpu_gemm-*.so")
    good = lib.read_bytes()
    # an ELF header whose one program header (size 0) points past the file's end
    bogus = bytearray(good[:64])
    bogus[32:48] = (60).to_bytes(8, "little") + bytes(8)  # program headers at 60, no sections
    bogus[54:62] = bytes([0, 0, 1, 0, 0, 0, 0, 0])  # one program header of size 0
    for bad in (good[:5000], good[:1000], b"", Path("/bin/true").read_bytes(), bytes(bogus)):
        lib.write_bytes(bad)
        rc, out = _probe(tmp_path)
        assert rc == 0 and "available True" in out, (len(bad), rc, out[-500:])
        assert lib.stat().st_size == len(good)


@needs_kernel
def test_a_compiler_that_writes_nothing_leaves_no_library_in_the_cache(tmp_path):
    """``CXX=true`` exits 0 without writing the library: the kernel is unavailable with the
    reason logged, and no empty file is left under the cache key for later runs to load."""
    rc, out = _probe(tmp_path, CXX="true")
    assert rc == 0 and "available False" in out and "did not build" in out, out[-500:]
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_mismatched_bias_gets_f_linears_error_not_onednns():
    """A bias of the wrong size or dtype past the kernel's row limit (oneDNN's side): oneDNN
    failed with "could not create a primitive descriptor"; :func:`ops.linear` now raises
    ``F.linear``'s error, which names the sizes or dtypes."""
    x, w = torch.randn(cpu_gemm.MAX_ROWS + 1, 40), torch.randn(7, 40)
    for bias in (torch.randn(6), torch.randn(7, dtype=torch.float64)):
        with pytest.raises(RuntimeError) as want:
            torch.nn.functional.linear(x, w, bias)
        with pytest.raises(RuntimeError) as got:
            ops.linear(x, w, bias)
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("value", ["false", "off", "no", "OFF"])
def test_the_switch_reads_the_usual_spellings_of_off(tmp_path, value):
    """``SPEC_GRAMMAR_CPU_GEMM=false`` (or off / no) left the kernel on: only "0" was read."""
    rc, out = _probe(tmp_path, SPEC_GRAMMAR_CPU_GEMM=value)
    assert rc == 0 and "available False" in out and "SPEC_GRAMMAR_CPU_GEMM" in out, out[-500:]


@needs_kernel
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
@pytest.mark.parametrize("cxx", ["", "g++ -g", " g++"])
def test_cxx_empty_or_with_arguments_still_builds(tmp_path, cxx):
    """``CXX`` exported empty means the default compiler, and ``CXX`` may carry arguments
    (``ccache g++``, ``g++ -m64``) as make reads it; both were taken for a missing compiler."""
    rc, out = _probe(tmp_path, CXX=cxx)
    assert rc == 0 and "available True" in out, out[-500:]


def test_fake_tensors_and_dispatch_modes_never_reach_the_kernel():
    """Under ``FakeTensorMode`` (shape propagation, export, compilers' tracing) a fake tensor's
    data pointer is no memory: the kernel read and wrote through it and the process died with
    SIGSEGV. Now :func:`ops.linear` gives ``F.linear``'s fake result; run in a child process so
    a crash fails this test instead of ending the run."""
    code = (
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from spec_grammar.worker.decoder import cpu_gemm, ops\n"
        "x, w, b = torch.randn(3, 40), torch.randn(7, 40), torch.randn(7)\n"
        "with FakeTensorMode() as mode:\n"
        "    fx, fw, fb = (mode.from_tensor(t) for t in (x, w, b))\n"
        "    assert cpu_gemm.linear(fx, fw, fb) is None\n"
        "    y = ops.linear(fx, fw, fb)\n"
        "    want = torch.nn.functional.linear(fx, fw, fb)\n"
        "    assert type(y) is type(want) and y.shape == want.shape == (3, 7)\n"
    )
    out = _run_fresh(code)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


def test_status_says_whether_the_kernel_runs_and_why_not():
    """``status()`` is "on" exactly when the kernel is available, else the reason; a missing
    compiler is a warning on stderr (the user can act on it), not only an INFO record."""
    assert (cpu_gemm.status() == "on") == cpu_gemm.available()
    code = "from spec_grammar.worker.decoder import cpu_gemm\nprint(cpu_gemm.status())\n"
    out = _run_fresh(code, CXX="no-such-compiler-xyz", SPEC_GRAMMAR_CPU_GEMM="1")
    assert out.returncode == 0, out.stderr
    if "AVX-512" in out.stdout:
        pytest.skip("no AVX-512 CPU here: the compiler is never looked for")
    assert "needs a C++ compiler" in out.stdout and "install g++" in out.stderr
