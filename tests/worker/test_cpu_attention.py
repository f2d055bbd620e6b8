"""The small-batch CPU attention kernel (:mod:`spec_grammar.worker.decoder.cpu_attention`)
against the SDPA path it replaces in the fused forward (``k_buf[rows, :, :kv_len]``, the mask
repeated per group member): causal chains, draft trees (ancestor masks) with padding nodes,
ragged batches, GQA groups, rows as a slice and as an index tensor, one key and many, one thread
and two; the inputs it declines; its switch."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from spec_grammar.worker.decoder import cpu_attention

needs_kernel = pytest.mark.skipif(
    not cpu_attention.available(), reason="no AVX-512 CPU or no C++ compiler here"
)
NEG = torch.finfo(torch.float32).min


def _sdpa(q, k_buf, v_buf, rows, kv_len, mask, scale):
    """The fused forward's SDPA path, as ``(b, n, heads, D)``."""
    b, heads, n, d = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    out = F.scaled_dot_product_attention(
        q.view(b, kv_heads, group * n, d),
        k_buf[rows, :, :kv_len],
        v_buf[rows, :, :kv_len],
        attn_mask=mask.repeat(1, 1, group, 1),
        scale=scale,
    )
    return out.reshape(b, heads, n, d).transpose(1, 2)


def _tree_mask(gen, lens, sizes, n, kv_len, chain):
    """``(b, 1, n, kv_len)`` additive mask of trees of ``sizes`` nodes (padded to ``n``: a
    padding node sees its prefix and itself, as the runner's) written after ``lens`` committed
    positions; ``chain``: node i's parent is i - 1, else a random earlier node."""
    allowed = torch.zeros(len(lens), n, kv_len, dtype=torch.bool)
    for r, (length, size) in enumerate(zip(lens, sizes)):
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, size):
            parent = i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen))
            anc[i] |= anc[parent]
        allowed[r, :, :length] = True
        allowed[r, :, length : length + n] = anc
    return torch.zeros(allowed.shape).masked_fill_(~allowed, NEG)[:, None]


def _case(seed, b, heads, kv_heads, d, n, lens, sizes, chain=True, rows_total=None, cap=None):
    gen = torch.Generator().manual_seed(seed)
    kv_len = max(lens) + n
    rows_total = rows_total or b + 3
    cap = cap or kv_len + 5
    k_buf = torch.randn(rows_total, kv_heads, cap, d, generator=gen)
    v_buf = torch.randn(rows_total, kv_heads, cap, d, generator=gen)
    q = torch.randn(b, heads, n, d, generator=gen)
    return q, k_buf, v_buf, kv_len, _tree_mask(gen, lens, sizes, n, kv_len, chain)


CASES = {
    # name: (b, heads, kv_heads, D, n, committed lengths, tree sizes, chain)
    "decode-batch-gqa3": (8, 9, 3, 64, 1, [300] * 8, [1] * 8, True),
    "chain-one-request": (1, 9, 3, 64, 16, [37], [16], True),
    "ragged-trees-padding": (5, 8, 2, 64, 7, [3, 40, 0, 17, 90], [7, 1, 4, 2, 5], False),
    "tree-mha-d128": (3, 4, 4, 128, 24, [10, 0, 5], [24, 11, 3], False),
    "d16-group8": (2, 8, 1, 16, 5, [2, 9], [5, 3], False),
    "d48-one-key": (1, 6, 3, 48, 1, [0], [1], True),
    "long-context": (2, 9, 3, 64, 3, [1500, 2100], [3, 2], False),
}


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_sdpa(name, threads):
    """Per case, with rows as a slice and as an index tensor out of order (the store's rows
    read in place): within float32 rounding of SDPA (differently ordered sums, a polynomial
    exp); a wrong mask row, group or key shifts outputs by O(0.1)."""
    b, heads, kv_heads, d, n, lens, sizes, chain = CASES[name]
    q, k_buf, v_buf, kv_len, mask = _case(1, b, heads, kv_heads, d, n, lens, sizes, chain)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        order = torch.randperm(k_buf.shape[0], generator=torch.Generator().manual_seed(2))[:b]
        for rows in (slice(1, 1 + b), order):
            at = cpu_attention.row_indices(rows, k_buf.shape[0])
            got = cpu_attention.attention(q, k_buf, v_buf, at, kv_len, mask, d**-0.5)
            want = _sdpa(q, k_buf, v_buf, rows, kv_len, mask, d**-0.5)
            assert got is not None and got.shape == (b, n, heads, d) and got.is_contiguous()
            assert (got - want).abs().max() < 2e-6, (name, rows, (got - want).abs().max())
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_queries_past_each_requests_count_are_zero_and_the_rest_unchanged():
    """``queries``: the padding tokens past each request's count come out zero, the others as
    with every query computed (each query's result depends on its own row only)."""
    b, heads, kv_heads, d, n, lens, sizes, chain = CASES["ragged-trees-padding"]
    q, k_buf, v_buf, kv_len, mask = _case(3, b, heads, kv_heads, d, n, lens, sizes, chain)
    rows = cpu_attention.row_indices(slice(0, b), k_buf.shape[0])
    full = cpu_attention.attention(q, k_buf, v_buf, rows, kv_len, mask, 0.125)
    counts = torch.tensor(sizes)
    part = cpu_attention.attention(q, k_buf, v_buf, rows, kv_len, mask, 0.125, counts)
    for r, size in enumerate(sizes):
        assert torch.equal(part[r, :size], full[r, :size])
        assert not part[r, size:].any()


@needs_kernel
def test_indices_outside_the_buffers_raise_before_any_work():
    """A row outside the store or a ``queries`` entry outside ``[0, n]`` would read or write
    outside the buffers in C++: a typed error, the output untouched; ``kv_len`` at the store's
    full capacity and ``n`` at :data:`MAX_QUERIES` still compute (the boundaries)."""
    b, heads, kv_heads, d, n = 2, 4, 2, 32, 3
    q, k_buf, v_buf, kv_len, mask = _case(5, b, heads, kv_heads, d, n, [5, 6], [3, 2])
    rows = cpu_attention.row_indices(slice(0, b), k_buf.shape[0])
    with pytest.raises(IndexError, match="outside the store"):
        cpu_attention.attention(q, k_buf, v_buf, torch.tensor([0, k_buf.shape[0]]), kv_len,
                                mask, 0.2)  # fmt: skip
    with pytest.raises(IndexError, match="outside the store"):
        cpu_attention.attention(q, k_buf, v_buf, torch.tensor([-1, 0]), kv_len, mask, 0.2)
    for bad in ([0, n + 1], [-1, 1]):
        with pytest.raises(ValueError, match="queries entry"):
            cpu_attention.attention(q, k_buf, v_buf, rows, kv_len, mask, 0.2, torch.tensor(bad))
    many = cpu_attention.MAX_QUERIES
    q, k_buf, v_buf, kv_len, mask = _case(6, 1, 2, 2, 16, many, [4], [many], cap=4 + many)
    assert kv_len == k_buf.shape[2]
    rows = cpu_attention.row_indices(slice(0, 1), k_buf.shape[0])
    got = cpu_attention.attention(q, k_buf, v_buf, rows, kv_len, mask, 0.25)
    want = _sdpa(q, k_buf, v_buf, slice(0, 1), kv_len, mask, 0.25)
    assert (got - want).abs().max() < 2e-6


def test_inputs_the_kernel_does_not_compute_are_declined():
    """float64, too many queries, head sizes not a multiple of 16 or past 128, a mask repeated
    per group, keys past the store's positions, rows outside the store, a negated view: None
    (the forward then runs SDPA)."""
    b, heads, kv_heads, d, n = 2, 4, 2, 32, 3
    q, k_buf, v_buf, kv_len, mask = _case(4, b, heads, kv_heads, d, n, [5, 6], [3, 2])
    rows = cpu_attention.row_indices(slice(0, b), k_buf.shape[0])
    args = (q, k_buf, v_buf, rows, kv_len, mask, 0.2)
    if cpu_attention.available():
        assert cpu_attention.attention(*args) is not None
    many = cpu_attention.MAX_QUERIES + 1
    big = _case(4, 1, 2, 2, 16, many, [0], [many])
    odd = _case(4, 1, 2, 2, 8, 1, [3], [1])
    wide = _case(4, 1, 2, 2, 144, 1, [3], [1])
    declined = [
        (q.double(), k_buf.double(), v_buf.double(), rows, kv_len, mask.double(), 0.2),
        (big[0], big[1], big[2], rows[:1], big[3], big[4], 0.25),
        (odd[0], odd[1], odd[2], rows[:1], odd[3], odd[4], 0.3),
        (wide[0], wide[1], wide[2], rows[:1], wide[3], wide[4], 0.1),
        (q, k_buf, v_buf, rows, kv_len, mask.repeat(1, 1, 2, 1), 0.2),
        (q, k_buf, v_buf, rows, k_buf.shape[2] + 1, mask, 0.2),
        (torch._neg_view(-q), k_buf, v_buf, rows, kv_len, mask, 0.2),
    ]
    for i, bad in enumerate(declined):
        assert cpu_attention.attention(*bad) is None, i
    cap = k_buf.shape[0]
    assert cpu_attention.row_indices(torch.tensor([0, cap]), cap) is None
    assert cpu_attention.row_indices(torch.tensor([-1, 0]), cap) is None
    assert torch.equal(cpu_attention.row_indices(slice(2, 5), cap), torch.tensor([2, 3, 4]))


@pytest.mark.integration  # a fresh interpreter per value
@pytest.mark.parametrize("value", ["0", "off"])
def test_the_switch_turns_the_kernel_off_and_says_so(value):
    """``SPEC_GRAMMAR_CPU_ATTENTION=0`` (or off): no kernel, ``status()`` names the switch."""
    code = (
        "from spec_grammar.worker.decoder import cpu_attention\n"
        "print(cpu_attention.available(), cpu_attention.status())\n"
    )
    env = {**os.environ, "SPEC_GRAMMAR_CPU_ATTENTION": value}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "False" and "SPEC_GRAMMAR_CPU_ATTENTION" in out.stdout
