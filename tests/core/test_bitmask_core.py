"""Bitmask layout helpers against a plain per-bit reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_grammar import BitmaskError, allocate_token_bitmask, unpack_bitmask
from spec_grammar.bitmask import (
    allowed_token_ids,
    bitmask_width,
    check_bitmask,
    clear_padding_bits,
    pack_bool_mask,
)


def reference_allowed(bitmask, v):
    out = np.zeros((bitmask.shape[0], v), dtype=bool)
    for r in range(bitmask.shape[0]):
        for t in range(v):
            out[r, t] = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
    return out


@given(st.integers(1, 4), st.integers(1, 130), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_roundtrip(rows, v, rnd):
    dense = torch.tensor([[rnd.random() < 0.5 for _ in range(v)] for _ in range(rows)])
    packed = pack_bool_mask(dense)
    assert packed.dtype == torch.int32 and packed.shape == (rows, bitmask_width(v))
    assert np.array_equal(reference_allowed(packed, v), dense.numpy())
    assert torch.equal(unpack_bitmask(packed, v), dense)
    assert allowed_token_ids(packed[0], v) == dense[0].nonzero().flatten().tolist()


@pytest.mark.parametrize("n_tok", [1, 31, 32, 33, 63, 64, 95])
def test_clear_padding_bits(n_tok):
    bm = allocate_token_bitmask(3, 96)
    clear_padding_bits(bm, 1, 3, n_tok)
    dense = reference_allowed(bm, 96)
    assert dense[0].all()
    assert dense[1:, :n_tok].all() and not dense[1:, n_tok:].any()


def test_allocate_and_check():
    bm = allocate_token_bitmask(2, 49152)
    assert bm.shape == (2, 1536) and bm.dtype == torch.int32 and (bm == -1).all()
    check_bitmask(bm, 49152, 1)
    with pytest.raises(BitmaskError, match="int32"):
        check_bitmask(bm.to(torch.int64), 49152)
    with pytest.raises(BitmaskError, match="words per row"):
        check_bitmask(bm, 49153)
    with pytest.raises(BitmaskError, match="out of range"):
        check_bitmask(bm, 49152, 2)
    with pytest.raises(BitmaskError, match="contiguous"):
        check_bitmask(allocate_token_bitmask(2, 64 * 32)[:, ::2], 32 * 32)
    with pytest.raises(BitmaskError):
        allocate_token_bitmask(1, 0)
