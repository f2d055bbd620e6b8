"""CPU tests of the mask-apply and fused verification kernels against a plain reference.

Reference: unpack the bits one by one and ``masked_fill`` (independent of the integer tricks in
``spec_grammar/kernels/cpu.py``). The Triton kernels' logic is also run here through Triton's
interpreter (``TRITON_INTERPRET=1``, in a subprocess) when Triton is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec_grammar
from spec_grammar.errors import BitmaskError
from spec_grammar.kernels import masked_argmax, masked_softmax, row_argmax

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEG_INF = float("-inf")


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, indices=None) -> torch.Tensor:
    """Masked copy of ``logits``: bit ``t % 32`` of word ``t // 32`` clear, or ``t >= 32 * W``,
    means -inf."""
    out = logits.clone()
    rows = range(out.shape[0]) if indices is None else [int(i) for i in indices]
    vocab, width = out.shape[1], bitmask.shape[1]
    for i, r in enumerate(rows):
        allowed = torch.zeros(vocab, dtype=torch.bool)
        for t in range(min(vocab, 32 * width)):
            allowed[t] = bool((int(bitmask[i, t // 32]) >> (t % 32)) & 1)
        out[r] = out[r].masked_fill(~allowed, NEG_INF)
    return out


def random_case(rows: int, vocab: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32, generator=g)
    if rows > 2:
        mask[0] = 0  # nothing allowed
        mask[1] = -1  # everything allowed (within the mask)
        mask[2, ::2] = 0  # alternate all-zero and mixed words
    return logits, mask


def applied(logits, mask, **kw):
    out = logits.clone()
    spec_grammar.apply_token_bitmask_inplace(out, mask, **kw)
    return out


# vocab, mask width: multiple of 32, not a multiple, logits wider than the mask (padded vocab:
# extra columns masked), logits narrower (mask bits past V ignored), tiny.
SHAPES = [(256, 8), (100, 4), (200, 4), (70, 4), (7, 1), (33, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", SHAPES)
def test_apply_matches_reference(dtype, vocab, width):
    logits, mask = random_case(5, vocab, width, dtype, seed=vocab * width)
    assert torch.equal(applied(logits, mask), reference_apply(logits, mask))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 150),
    width=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_apply_random_shapes(rows, vocab, width, dtype, seed):
    logits, mask = random_case(rows, vocab, width, dtype, seed)
    assert torch.equal(applied(logits, mask), reference_apply(logits, mask))


def test_apply_edge_rows_and_padding_columns():
    logits, mask = random_case(4, 100, 3, torch.float32)  # 96 mask bits, 100 logits
    out = applied(logits, mask)
    assert torch.isinf(out[0]).all()  # all-zero row
    assert torch.equal(out[1, :96], logits[1, :96])  # all-one row keeps every covered logit
    assert (out[:, 96:] == NEG_INF).all()  # columns past the mask are disallowed


def test_apply_chunks_rows(monkeypatch):
    """Row chunking of the torch path (chunk boundaries inside the batch)."""
    from spec_grammar.kernels import cpu

    monkeypatch.setattr(cpu, "CHUNK_TOKENS", 10)
    logits, mask = random_case(7, 70, 3, torch.bfloat16)
    assert torch.equal(applied(logits, mask), reference_apply(logits, mask))
    idx = [6, 1, 3, 0]
    assert torch.equal(
        applied(logits, mask[:4], indices=idx), reference_apply(logits, mask[:4], idx)
    )


def test_disallowed_nan_and_inf_become_neg_inf_allowed_keep_bits():
    logits = torch.tensor([[float("nan"), float("inf"), 1.0, float("nan"), -0.0]])
    mask = torch.tensor([[0b11100]], dtype=torch.int32)
    out = applied(logits, mask)
    assert out[0, :2].tolist() == [NEG_INF, NEG_INF]
    assert out[0, 2] == 1.0 and torch.isnan(out[0, 3]) and torch.signbit(out[0, 4])


@pytest.mark.parametrize(
    "make_idx", [list, lambda x: torch.tensor(x, dtype=torch.int32), torch.tensor]
)
def test_apply_indices(make_idx):
    logits, mask = random_case(6, 100, 4, torch.float32)
    idx = [4, 0, 2]
    out = applied(logits, mask[:3], indices=make_idx(idx))
    assert torch.equal(out, reference_apply(logits, mask[:3], idx))
    untouched = [1, 3, 5]
    assert torch.equal(out[untouched], logits[untouched])


@pytest.mark.parametrize(
    "make_view",
    [
        lambda x: x.t().contiguous().t(),  # column-major storage
        lambda x: torch.cat([x, x], dim=1)[:, : x.shape[1]],  # row stride > V
        lambda x: torch.stack([x, x], dim=1)[:, 0],  # rows of a bigger tensor
    ],
)
def test_apply_non_contiguous_logits_handled(make_view):
    logits, mask = random_case(4, 100, 4, torch.bfloat16)
    view = make_view(logits.clone())
    assert not view.is_contiguous()
    spec_grammar.apply_token_bitmask_inplace(view, mask)
    assert torch.equal(view, reference_apply(logits, mask))


def test_apply_non_contiguous_bitmask_handled():
    logits, mask = random_case(4, 100, 4, torch.float32)
    wide = torch.cat([mask, mask], dim=1)[:, :4]
    assert torch.equal(applied(logits, wide), reference_apply(logits, mask))


@pytest.mark.parametrize(
    "logits,mask,kw,match",
    [
        (
            torch.zeros(2, 64, dtype=torch.float64),
            torch.zeros(2, 2, dtype=torch.int32),
            {},
            "dtype",
        ),
        (torch.zeros(64), torch.zeros(1, 2, dtype=torch.int32), {}, "2-D"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), {}, "int32"),
        (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), {}, "3 rows, expected 2"),
        (
            torch.zeros(4, 64),
            torch.zeros(2, 2, dtype=torch.int32),
            {"indices": [0, 4]},
            r"\[0, 4\)",
        ),
        (torch.zeros(4, 64), torch.zeros(2, 2, dtype=torch.int32), {"indices": [1, 1]}, "distinct"),
        (
            torch.zeros(4, 64),
            torch.zeros(1, 2, dtype=torch.int32),
            {"indices": torch.tensor([[1]])},
            "1-D",
        ),
        (
            torch.zeros(4, 64),
            torch.zeros(1, 2, dtype=torch.int32),
            {"indices": torch.tensor([1.0])},
            "int32",
        ),
    ],
)
def test_apply_rejects_bad_input(logits, mask, kw, match):
    with pytest.raises(BitmaskError, match=match):
        spec_grammar.apply_token_bitmask_inplace(logits, mask, **kw)


# ----------------------------------------------------------------------------- fused


def expected_argmax(logits, mask, indices=None):
    x = reference_apply(logits, mask, indices).float()
    if indices is not None:
        x = x[list(indices)]
    best, arg = x.max(dim=1)
    return torch.where(best == NEG_INF, -1, arg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", SHAPES)
def test_masked_argmax_equals_apply_then_argmax(dtype, vocab, width):
    logits, mask = random_case(5, vocab, width, dtype, seed=vocab)
    got = masked_argmax(logits, mask)
    assert got.dtype == torch.int64 and got[0] == -1  # fully-masked row
    assert torch.equal(got, expected_argmax(logits, mask))
    idx = [3, 1]
    assert torch.equal(
        masked_argmax(logits, mask[:2], indices=idx), expected_argmax(logits, mask[:2], idx)
    )


def test_masked_argmax_ties_pick_first_and_ignores_disallowed_maximum():
    logits = torch.tensor([[5.0, 1.0, 3.0, 3.0, 9.0, 3.0]])
    mask = torch.tensor([[0b101110]], dtype=torch.int32)  # 9.0 at id 4 is disallowed
    assert masked_argmax(logits, mask).tolist() == [2]
    g = torch.Generator().manual_seed(1)
    ties = torch.randint(0, 3, (6, 300), generator=g).float()  # many equal maxima per row
    _, mask = random_case(6, 300, 10, torch.float32, seed=3)
    assert torch.equal(masked_argmax(ties, mask), expected_argmax(ties, mask))


def test_masked_argmax_when_the_plain_argmax_is_or_is_not_allowed():
    """Rows whose plain argmax is allowed (it is then the answer) mixed with rows where it is
    not: an equal maximum before an allowed one, the maximum past the mask's width, NaN-free
    rows of -inf but one allowed token."""
    logits = torch.full((4, 40), -1.0)
    logits[0, 7] = 4.0  # allowed maximum
    logits[1, 3] = logits[1, 5] = 6.0  # first maximum disallowed, the equal one at 5 allowed
    logits[2, 35] = 9.0  # maximum past the 32 tokens the one-word mask covers
    logits[2, 10] = 2.0
    logits[3] = NEG_INF
    logits[3, 20] = 0.5
    mask = torch.zeros(4, 1, dtype=torch.int32)
    mask[0, 0] = 1 << 7
    mask[1, 0] = (1 << 5) | (1 << 9)
    mask[2, 0] = (1 << 10) | (1 << 11)
    mask[3, 0] = (1 << 20) | (1 << 2)
    assert masked_argmax(logits, mask).tolist() == [7, 5, 10, 20]
    assert masked_argmax(logits, mask[[2, 0]], indices=[2, 0]).tolist() == [10, 7]


def test_row_argmax_first_maximum_and_minus_one_for_dead_rows():
    logits = torch.tensor(
        [[1.0, 3.0, 3.0], [NEG_INF, NEG_INF, NEG_INF], [NEG_INF, -5.0, NEG_INF], [2.0, 0.0, 2.0]]
    )
    assert row_argmax(logits).tolist() == [1, -1, 1, 0]
    batched = logits.reshape(2, 2, 3)
    assert row_argmax(batched).tolist() == [[1, -1], [1, 0]]
    # where the mask allows it, it is the masked argmax (the verifier's shortcut)
    everything = torch.full((4, 1), -1, dtype=torch.int32)
    assert row_argmax(logits).tolist() == masked_argmax(logits, everything).tolist()


def test_masked_argmax_row_with_only_neg_inf_allowed_is_minus_one():
    logits = torch.tensor([[NEG_INF, 2.0]])
    assert masked_argmax(logits, torch.tensor([[0b01]], dtype=torch.int32)).tolist() == [-1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("vocab,width", [(256, 8), (100, 3), (70, 4)])
def test_masked_softmax_equals_apply_then_softmax(dtype, log, vocab, width):
    logits, mask = random_case(5, vocab, width, dtype, seed=width)
    got = masked_softmax(logits, mask, 0.7, log=log)
    assert got.dtype == torch.float32 and got.shape == (5, vocab)
    x = reference_apply(logits, mask).float() / 0.7
    ref = torch.log_softmax(x, 1) if log else torch.softmax(x, 1)
    # Row 0 is fully masked: zeros (log: -inf) instead of NaN.
    assert (got[0] == (NEG_INF if log else 0.0)).all()
    assert torch.equal(got[1:], ref[1:])


def test_masked_softmax_per_row_temperature_and_indices():
    logits, mask = random_case(6, 100, 4, torch.float32)
    temps = torch.tensor([0.5, 1.0, 2.0])
    idx = [5, 3, 4]
    got = masked_softmax(logits, mask[3:], temps, indices=idx)
    x = reference_apply(logits, mask[3:], idx)[idx].float() / temps[:, None]
    assert torch.equal(got, torch.softmax(x, 1))
    assert torch.allclose(got.sum(1), torch.ones(3))


@pytest.mark.parametrize(
    "temperature", [0.0, -1.0, float("nan"), torch.tensor([1.0, 0.0]), torch.ones(3)]
)
def test_masked_softmax_rejects_bad_temperature(temperature):
    logits, mask = random_case(2, 64, 2, torch.float32)
    with pytest.raises(BitmaskError, match="temperature"):
        masked_softmax(logits, mask, temperature)


# ----------------------------------------------------------------------------- Triton logic

_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import torch
    from spec_grammar.kernels import fused, cpu
    from spec_grammar.kernels.triton import apply_token_bitmask_inplace_triton
    fused.WORDS_PER_BLOCK, fused.TARGET_PROGRAMS = 2, 8  # several chunks and loop steps per row
    g = torch.Generator().manual_seed(0)
    # bf16 is left to the GPU tests: older Triton interpreters lack it.
    for dtype, vocab, width in ((torch.float32, 256, 8), (torch.float16, 100, 3), (torch.float32, 70, 4)):
        logits = torch.randn(5, vocab, generator=g).to(dtype)
        mask = torch.randint(-2**31, 2**31 - 1, (5, width), dtype=torch.int32, generator=g)
        mask[0], mask[1], mask[2, ::2] = 0, -1, 0
        idx = torch.tensor([4, 0, 2])
        for i, m in ((None, mask), (idx, mask[:3])):
            a, b = logits.clone(), logits.clone()
            apply_token_bitmask_inplace_triton(a, m, indices=i, words_per_program=2)
            cpu.apply_token_bitmask_inplace_torch(b, m, indices=i)
            assert torch.equal(a, b), ("apply", dtype, vocab, width)
            assert torch.equal(fused.masked_argmax_triton(logits, m, indices=i),
                               cpu.masked_argmax_torch(logits, m, indices=i)), ("argmax", vocab)
            for log in (False, True):
                p = fused.masked_softmax_triton(logits, m, 0.7, log=log, indices=i)
                q = cpu.masked_softmax_torch(logits, m, 0.7, log=log, indices=i)
                assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), ("softmax", log)
    print("interpreted kernels ok")
    """
)


def test_triton_kernels_logic_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRET_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interpreted kernels ok" in proc.stdout
