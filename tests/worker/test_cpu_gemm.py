"""The small-batch CPU projection kernel (:mod:`spec_grammar.worker.decoder.cpu_gemm`): against
float64 ``F.linear``, row results independent of the batch, the shapes it declines, and the
fallback to oneDNN when it cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from spec_grammar.worker.decoder import cpu_gemm, ops

needs_kernel = pytest.mark.skipif(
    not cpu_gemm.available(), reason="no AVX-512 CPU or no C++ compiler here"
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
    run_env = {**os.environ, "SPEC_GRAMMAR_CACHE": str(tmp_path), **env}
    out = subprocess.run(
        [sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if reason == "build" and not cpu_gemm.available():
        pytest.skip("no AVX-512 CPU here: the build is never tried")
    assert ("SPEC_GRAMMAR_CPU_GEMM=0" if reason != "build" else "did not build") in out.stderr
