"""CUDA kernels against the CPU path: bit-exact apply and argmax, float32-close softmax,
and replay inside a CUDA graph. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import spec_grammar
from spec_grammar.kernels import HAS_TRITON, masked_argmax, masked_softmax

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# vocab, mask width: multiple of 32, not a multiple, padded vocab (V > 32 W), V < 32 W, real
# vocabularies (SmolLM2 49,152 and Gemma-3 262,144 padded to 262,208).
SHAPES = [(256, 8), (100, 4), (200, 4), (70, 4), (49_152, 1_536), (262_208, 8_192)]


def case(rows, vocab, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32, generator=g)
    mask[0], mask[1], mask[2, ::2] = 0, -1, 0
    sparse = torch.rand(rows, width, generator=g) < 0.9
    mask[3][sparse[3]] = 0  # grammar-like row: most words all zero
    return logits, mask


def test_triton_is_used():
    assert HAS_TRITON


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", SHAPES)
def test_apply_cuda_equals_cpu(dtype, vocab, width):
    logits, mask = case(6, vocab, width, dtype, seed=vocab)
    cpu = logits.clone()
    spec_grammar.apply_token_bitmask_inplace(cpu, mask)
    gpu = logits.cuda()
    spec_grammar.apply_token_bitmask_inplace(gpu, mask.cuda())
    assert torch.equal(gpu.cpu(), cpu)
    idx = [5, 0, 3]
    cpu = logits.clone()
    spec_grammar.apply_token_bitmask_inplace(cpu, mask[:3], indices=idx)
    makers = (
        list,
        lambda x: torch.tensor(x, device="cuda"),
        lambda x: torch.tensor(x, dtype=torch.int32, device="cuda"),
    )
    for make in makers:
        gpu = logits.cuda()
        spec_grammar.apply_token_bitmask_inplace(gpu, mask[:3].cuda(), indices=make(idx))
        assert torch.equal(gpu.cpu(), cpu)


def test_apply_cuda_strided_logits():
    logits, mask = case(6, 1000, 32, torch.bfloat16, seed=1)
    cpu = logits.clone()
    spec_grammar.apply_token_bitmask_inplace(cpu, mask)
    wide = torch.cat([logits, logits], dim=1).cuda()[:, :1000]  # row stride 2000 (Triton path)
    spec_grammar.apply_token_bitmask_inplace(wide, mask.cuda())
    assert torch.equal(wide.cpu(), cpu)
    colmajor = logits.cuda().t().contiguous().t()  # column stride != 1 (torch path)
    spec_grammar.apply_token_bitmask_inplace(colmajor, mask.cuda())
    assert torch.equal(colmajor.cpu(), cpu)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_cached_launch_every_variant(dtype):
    """After its first call a variant launches from the cache (the eager path): each one
    (16-byte vectors or not: aligned rows, a row stride or vocabulary off the vector size, a
    storage offset) stays bit-identical to the CPU path over calls, as do the calls the cache
    does not take (indices, a mask with column stride 2)."""
    from spec_grammar.kernels import triton as ktriton

    base, mask = case(8, 4_160, 130, dtype, seed=11)
    views = {
        "aligned": lambda t: t,
        "odd stride": lambda t: torch.cat([t, t[:, :3]], dim=1)[:, :4_160],
        "odd vocab": lambda t: t[:, :4_157],
        "storage offset": lambda t: torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape),
    }
    ktriton._CACHE.clear()
    for name, view in views.items():
        for _ in range(3):  # compile, then cached launches
            cpu = view(base.clone())
            spec_grammar.apply_token_bitmask_inplace(cpu, mask)
            gpu = view(base.cuda())
            spec_grammar.apply_token_bitmask_inplace(gpu, mask.cuda())
            assert torch.equal(gpu.cpu(), cpu), name
    vec = 16 // base.element_size()
    assert {k[2] for k in ktriton._CACHE.launches} == {1, vec}  # both variants cached
    gpu_mask = mask.cuda()
    assert ktriton.launch_cached(base.cuda(), gpu_mask)
    assert not ktriton.launch_cached(base.cuda(), gpu_mask.float())  # checked path: error
    with pytest.raises(spec_grammar.BitmaskError):
        spec_grammar.apply_token_bitmask_inplace(base.cuda(), gpu_mask[:5])

    def col_stride_2(m):
        return torch.stack([m, m], dim=2).flatten(1).cuda()[:, ::2]

    cpu = base.clone()
    spec_grammar.apply_token_bitmask_inplace(cpu, mask)
    gpu = base.cuda()
    spec_grammar.apply_token_bitmask_inplace(gpu, col_stride_2(mask))
    assert torch.equal(gpu.cpu(), cpu)
    cpu = base.clone()
    spec_grammar.apply_token_bitmask_inplace(cpu, mask[[6, 1, 4]], indices=[6, 1, 4])
    for idx in ([6, 1, 4], torch.tensor([6, 6, 1, 1, 4, 4], device="cuda")[::2]):
        gpu = base.cuda()
        spec_grammar.apply_token_bitmask_inplace(gpu, col_stride_2(mask[[6, 1, 4]]), indices=idx)
        assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", [(256, 8), (49_152, 1_536), (128_256, 4_008)])
def test_apply_equals_xgrammar_cuda_kernel(dtype, vocab, width):
    """Bit-identical to xgrammar's CUDA kernel (``backend="cuda"``; it masks only the
    ``32 * W`` columns its mask covers, so the shapes here have ``V == 32 * W``)."""
    xgr = pytest.importorskip("xgrammar")
    try:  # compiles the extension with nvcc on first import
        import xgrammar.kernels.apply_token_bitmask_inplace_cuda  # noqa: F401
    except ImportError as e:
        pytest.skip(f"xgrammar's CUDA kernel does not build here: {e}")
    logits, mask = case(64, vocab, width, dtype, seed=vocab + 1)
    ours, theirs = logits.cuda(), logits.cuda()
    spec_grammar.apply_token_bitmask_inplace(ours, mask.cuda())
    xgr.apply_token_bitmask_inplace(theirs, mask.cuda(), backend="cuda")
    assert torch.equal(ours, theirs)
    cpu = logits.clone()
    spec_grammar.apply_token_bitmask_inplace(cpu, mask)
    assert torch.equal(ours.cpu(), cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", SHAPES)
def test_fused_cuda_equals_cpu(dtype, vocab, width):
    # Small vocabularies take one chunk per row (one launch), large ones several chunks.
    rows = 6 if vocab < 10_000 else 64
    logits, mask = case(rows, vocab, width, dtype, seed=width)
    lg, mg = logits.cuda(), mask.cuda()
    want = masked_argmax(logits, mask)
    assert want[0] == -1
    assert torch.equal(masked_argmax(lg, mg).cpu(), want)
    idx = torch.tensor([5, 0, 3], device="cuda")
    want_idx = masked_argmax(logits, mask[:3], indices=[5, 0, 3])
    assert torch.equal(masked_argmax(lg, mg[:3], indices=idx).cpu(), want_idx)
    for log in (False, True):
        for temp in (0.7, torch.rand(6, generator=torch.Generator().manual_seed(0)) + 0.3):
            n = 6
            p_cpu = masked_softmax(logits[:n], mask[:n], temp, log=log)
            t_gpu = temp if isinstance(temp, float) else temp.cuda()
            p_gpu = masked_softmax(lg[:n], mg[:n], t_gpu, log=log).cpu()
            assert torch.equal(torch.isinf(p_gpu), torch.isinf(p_cpu))
            fin = torch.isfinite(p_cpu)
            assert torch.allclose(p_gpu[fin], p_cpu[fin], rtol=2e-5, atol=1e-6 if log else 1e-8)


def test_fused_argmax_ties_first_index_cuda():
    g = torch.Generator().manual_seed(2)
    ties = torch.randint(0, 3, (64, 49_152), generator=g).to(torch.bfloat16)
    _, mask = case(64, 49_152, 1_536, torch.float32, seed=4)
    assert torch.equal(masked_argmax(ties.cuda(), mask.cuda()).cpu(), masked_argmax(ties, mask))


def test_cuda_graph_capture_and_replay():
    rows, vocab, width = 16, 49_152, 1_536
    logits, mask = case(rows, vocab, width, torch.bfloat16, seed=7)
    static_logits, static_mask = logits.cuda(), mask.cuda()
    idx = torch.arange(0, rows, 2, device="cuda")
    work, work_idx = static_logits.clone(), static_logits.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        spec_grammar.apply_token_bitmask_inplace(work, static_mask)
        masked_argmax(static_logits, static_mask)
        masked_softmax(static_logits, static_mask, 0.5)
        spec_grammar.apply_token_bitmask_inplace(work_idx, static_mask[: rows // 2], indices=idx)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work.copy_(static_logits)
        spec_grammar.apply_token_bitmask_inplace(work, static_mask)
        work_idx.copy_(static_logits)
        spec_grammar.apply_token_bitmask_inplace(work_idx, static_mask[: rows // 2], indices=idx)
        arg = masked_argmax(static_logits, static_mask)
        probs = masked_softmax(static_logits, static_mask, 0.5)
    for seed in (8, 9):  # new data in the same buffers, then replay
        new_logits, new_mask = case(rows, vocab, width, torch.bfloat16, seed=seed)
        static_logits.copy_(new_logits)
        static_mask.copy_(new_mask)
        graph.replay()
        torch.cuda.synchronize()
        cpu = new_logits.clone()
        spec_grammar.apply_token_bitmask_inplace(cpu, new_mask)
        assert torch.equal(work.cpu(), cpu)
        cpu = new_logits.clone()
        spec_grammar.apply_token_bitmask_inplace(cpu, new_mask[: rows // 2], indices=idx.tolist())
        assert torch.equal(work_idx.cpu(), cpu)
        assert torch.equal(arg.cpu(), masked_argmax(new_logits, new_mask))
        ref = masked_softmax(new_logits, new_mask, 0.5)
        assert torch.allclose(probs.cpu(), ref, rtol=2e-5, atol=1e-8)
