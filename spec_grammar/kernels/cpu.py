"""Vectorized torch apply: works on any device, the reference every kernel is tested against."""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def apply_token_bitmask_inplace_cpu(logits: torch.Tensor, bitmask: torch.Tensor, *, indices=None) -> None:
    """``logits[rows, ~allowed] = -inf``; columns past ``32 * W`` are disallowed."""
    v = logits.shape[1]
    width = bitmask.shape[1]
    covered = min(v, width * 32)
    allowed = ((bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1).bool().flatten(-2)[:, :covered]
    if indices is None:
        logits[:, :covered].masked_fill_(~allowed, float("-inf"))
        if covered < v:
            logits[:, covered:] = float("-inf")
        return
    idx = torch.as_tensor(indices, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx)
    sub[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < v:
        sub[:, covered:] = float("-inf")
    logits.index_copy_(0, idx, sub)
