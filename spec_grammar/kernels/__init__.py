"""Mask-apply and fused verification kernels: one checked function each, one file per device.

* :mod:`.cpu`: torch paths (vectorized integer ops); the CPU implementation and the fallback on
  any device without Triton. They define the results every other path must reproduce.
* :mod:`.triton`: the CUDA apply, one Triton launch (after the first call, a cached launch that
  skips Triton's JIT: the eager path engines call once per step).
* :mod:`.fused`: CUDA masked argmax (greedy verify) and masked (log-)softmax with temperature
  (stochastic verify), reading logits and mask without writing masked logits.

Bitmask layout (see :mod:`spec_grammar.bitmask`): ``(rows, W)`` int32, bit ``t % 32`` of word
``t // 32`` set = token ``t`` allowed. The logits width ``V`` may differ from ``32 * W``:
columns past the mask are disallowed, mask bits past ``V`` are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import BitmaskError
from .cpu import apply_token_bitmask_inplace_torch, masked_argmax_torch, masked_softmax_torch

try:
    from .fused import masked_argmax_triton, masked_softmax_triton
    from .triton import apply_token_bitmask_inplace_triton, launch_cached

    HAS_TRITON = True
except ImportError:  # torch without Triton (CPU wheels): CUDA tensors take the torch path
    HAS_TRITON = False

__all__ = [
    "apply_token_bitmask_inplace",
    "masked_argmax",
    "masked_softmax",
    "row_argmax",
    "NONFINITE",
    "HAS_TRITON",
]

Indices = torch.Tensor | Sequence[int] | None
_FLOAT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices) -> torch.Tensor | None:
    """Validate shapes/dtypes/devices; return ``indices`` as a tensor on ``logits.device``."""
    if not isinstance(logits, torch.Tensor) or not isinstance(bitmask, torch.Tensor):
        raise BitmaskError("logits and bitmask must be torch.Tensors")
    if logits.dtype not in _FLOAT_DTYPES:
        raise BitmaskError(f"logits dtype must be float32/float16/bfloat16, got {logits.dtype}")
    if logits.dim() != 2:
        raise BitmaskError(f"logits must be 2-D (rows, vocab), got shape {tuple(logits.shape)}")
    if bitmask.dtype is not torch.int32 or bitmask.dim() != 2:
        raise BitmaskError(
            f"bitmask must be 2-D int32, got {bitmask.dtype} of shape {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device:
        raise BitmaskError(f"bitmask is on {bitmask.device} but logits are on {logits.device}")
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
            raise BitmaskError(
                f"indices must be a 1-D int32/int64 tensor, got {indices.dtype} of shape "
                f"{tuple(indices.shape)}"
            )
        if indices.device.type != "cpu" and indices.device != logits.device:
            raise BitmaskError(f"indices are on {indices.device} but logits are on {logits.device}")
    expected_rows = logits.shape[0] if indices is None else len(indices)
    if bitmask.shape[0] != expected_rows:
        raise BitmaskError(
            f"bitmask has {bitmask.shape[0]} rows, expected {expected_rows} "
            f"({'len(indices)' if indices is not None else 'logits rows'})"
        )
    if indices is None:
        return None
    # Values are checked only where that needs no device synchronization.
    if not isinstance(indices, torch.Tensor) or indices.device.type == "cpu":
        host = torch.as_tensor(indices, dtype=torch.int64)
        if host.dim() != 1:
            raise BitmaskError(f"indices must be 1-D, got shape {tuple(host.shape)}")
        if host.numel() and (int(host.min()) < 0 or int(host.max()) >= logits.shape[0]):
            raise BitmaskError(f"indices must lie in [0, {logits.shape[0]}), got {host.tolist()}")
        if host.unique().numel() != host.numel():
            raise BitmaskError(f"indices must be distinct, got {host.tolist()}")
        return host.to(logits.device, non_blocking=True)
    # The kernels read CUDA indices with unit stride.
    return indices.long() if logits.device.type != "cuda" else indices.contiguous()


def _use_triton(logits: torch.Tensor) -> bool:
    return HAS_TRITON and logits.is_cuda and logits.stride(1) == 1


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, *, indices: Indices = None
) -> None:
    """Set disallowed logits to ``-inf`` in place.

    Args:
        logits: ``(rows, V)`` float32 / float16 / bfloat16, any device, any strides.
        bitmask: ``(rows, W)`` int32, or ``(len(indices), W)``; same device as ``logits``.
        indices: logits rows to mask (row ``indices[i]`` uses bitmask row ``i``), distinct; a
            list, or an int32/int64 tensor. ``None`` = every row.

    Disallowed entries become exactly ``-inf``; allowed ones keep their bits. On CUDA with unit
    column stride this is one Triton launch (:mod:`.triton`) with no host synchronization, so it
    can be captured in a CUDA graph (pass ``indices`` as a CUDA tensor then; their values are
    not checked on the device). Called eagerly without ``indices``, a variant compiled before
    is launched from :mod:`.triton`'s cache with its own argument checks, for a host time of
    about 9 µs per call on the H200 machine (``benchmarks/results/kernels-h200.md``). Elsewhere
    the torch path (:mod:`.cpu`) runs.

    Raises:
        BitmaskError: wrong dtype, rank, row count or device; indices out of range or repeated
            (checked when they are on the host).
    """
    # Engines call this eagerly once per step, where at small batches the host time is the
    # cost: the common call (no indices) of a variant compiled before launches the cached
    # kernel after that function's own checks, without the ones below.
    if indices is None and HAS_TRITON and launch_cached(logits, bitmask):
        return
    idx = _check(logits, bitmask, indices)
    if _use_triton(logits):
        apply_token_bitmask_inplace_triton(logits, bitmask.contiguous(), indices=idx)
    else:
        apply_token_bitmask_inplace_torch(
            logits, bitmask, indices=idx if idx is None else idx.long()
        )


def masked_argmax(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None
) -> torch.Tensor:
    """Greedy verify: the best allowed token of each row, without writing masked logits.

    Args:
        logits: ``(rows, V)`` float32 / float16 / bfloat16 (not modified).
        bitmask, indices: as in :func:`apply_token_bitmask_inplace`.

    Returns:
        ``(n,)`` int64 on ``logits.device``, ``n = len(indices)`` or ``rows``: the index of the
        largest allowed logit (the first one on ties), equal to ``apply_token_bitmask_inplace``
        followed by ``argmax``; ``-1`` for a row where no allowed token has a logit above
        ``-inf`` (a fully-masked row). NaN logits give an unspecified index.

    On CUDA: one launch when ``rows`` fills the GPU, else two; no host synchronization.

    Raises:
        BitmaskError: as :func:`apply_token_bitmask_inplace`.
    """
    idx = _check(logits, bitmask, indices)
    if logits.shape[1] == 0 or bitmask.shape[1] == 0:  # no token at all, or none allowed
        return torch.full((bitmask.shape[0],), -1, dtype=torch.int64, device=logits.device)
    if _use_triton(logits):
        return masked_argmax_triton(logits, bitmask.contiguous(), indices=idx)
    return masked_argmax_torch(logits, bitmask, indices=idx if idx is None else idx.long())


#: :func:`row_argmax` of a row whose largest logit is NaN or +inf.
NONFINITE = -2


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The unmasked greedy choice of each row, in a form :func:`masked_argmax` can reuse.

    Args:
        logits: ``(..., V)`` floating, any device, ``V >= 1``.

    Returns ``(...)`` int64 on ``logits.device``: the first index of each row's largest logit,
    ``-1`` where every logit is ``-inf``, :data:`NONFINITE` (``-2``) where the largest is NaN or
    ``+inf`` (such a row has no greedy choice without its mask: the per-request path calls a
    row allowing no token when its masked maximum is not finite). Where a grammar allows that
    token it is also the row's :func:`masked_argmax` (no allowed token before it ties with it),
    and a ``-1`` row is ``-1`` under any mask, so a verifier checks one bitmask word per row on
    the host and masks only the other rows (:mod:`spec_grammar.worker.batch_verify`). Two
    kernels on CUDA, no host synchronization (capturable in a CUDA graph).
    """
    best, arg = logits.max(dim=-1)
    arg.masked_fill_(~torch.isfinite(best), NONFINITE)
    return arg.masked_fill_(best == float("-inf"), -1)


def masked_softmax(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    temperature: float | torch.Tensor,
    log: bool = False,
    *,
    indices: Indices = None,
) -> torch.Tensor:
    """Stochastic verify: ``softmax(masked_logits / temperature)`` (or its log) per row.

    Args:
        logits: ``(rows, V)`` float32 / float16 / bfloat16 (not modified).
        bitmask, indices: as in :func:`apply_token_bitmask_inplace`.
        temperature: a float > 0, or a ``(n,)`` floating tensor on ``logits.device`` with one
            temperature per output row (values must be > 0; on CUDA they are not checked).
        log: return log-probabilities (``log_softmax``) instead of probabilities.

    Returns:
        ``(n, V)`` float32, ``n = len(indices)`` or ``rows``: probabilities, 0 at disallowed
        tokens (log: ``-inf``). Equal (up to float32 rounding on CUDA) to applying the mask and
        calling ``torch.softmax(x.float() / temperature)``, except that a row with no allowed
        token of logit above ``-inf`` gives all zeros (log: all ``-inf``) instead of NaN.

    On CUDA: two launches (partial max/sum per row chunk, then combine and write), no host
    synchronization; the logits are read twice (the second time only where tokens are allowed).

    Raises:
        BitmaskError: as :func:`apply_token_bitmask_inplace`; a temperature that is not > 0, or
            a temperature tensor of the wrong shape or device.
    """
    idx = _check(logits, bitmask, indices)
    n = bitmask.shape[0]
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != (n,) or not temperature.is_floating_point():
            raise BitmaskError(
                f"temperature tensor must be floating with shape ({n},), got "
                f"{temperature.dtype} of shape {tuple(temperature.shape)}"
            )
        if temperature.device != logits.device:
            raise BitmaskError(
                f"temperature is on {temperature.device} but logits are on {logits.device}"
            )
        if temperature.device.type == "cpu" and n and not bool((temperature > 0).all()):
            raise BitmaskError(f"temperatures must be > 0, got {temperature.tolist()}")
    else:
        temperature = float(temperature)
        if not (temperature > 0 and math.isfinite(temperature)):
            raise BitmaskError(f"temperature must be a finite float > 0, got {temperature}")
    if _use_triton(logits):
        return masked_softmax_triton(
            logits, bitmask.contiguous(), temperature, log=log, indices=idx
        )
    return masked_softmax_torch(
        logits, bitmask, temperature, log=log, indices=idx if idx is None else idx.long()
    )
