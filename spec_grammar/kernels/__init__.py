"""Mask-apply kernels, one file per device behind one dispatching function."""

from __future__ import annotations

import torch

from ..errors import BitmaskError
from .cpu import apply_token_bitmask_inplace_cpu

__all__ = ["apply_token_bitmask_inplace"]


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices) -> None:
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise BitmaskError(f"logits dtype must be float32/float16/bfloat16, got {logits.dtype}")
    if logits.dim() != 2:
        raise BitmaskError(f"logits must be 2-D (rows, vocab), got shape {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise BitmaskError(
            f"bitmask must be 2-D int32, got {bitmask.dtype} of shape {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device:
        raise BitmaskError(f"bitmask is on {bitmask.device} but logits are on {logits.device}")
    expected_rows = logits.shape[0] if indices is None else len(indices)
    if bitmask.shape[0] != expected_rows:
        raise BitmaskError(
            f"bitmask has {bitmask.shape[0]} rows, expected {expected_rows} "
            f"({'len(indices)' if indices is not None else 'logits rows'})"
        )


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, *, indices=None) -> None:
    """See :func:`spec_grammar.bitmask.apply_token_bitmask_inplace`."""
    _check(logits, bitmask, indices)
    apply_token_bitmask_inplace_cpu(logits, bitmask, indices=indices)
