"""The token bitmask: one layout for every backend, one apply path.

Layout: ``torch.int32`` tensor of shape ``(rows, ceil(V / 32))``; bit ``t % 32`` of word
``t // 32`` is 1 when token ``t`` is allowed. ``V`` is the logits width (the model's padded
vocabulary); ids at or above the tokenizer's vocabulary are never allowed in a constrained row.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import BitmaskError

__all__ = [
    "allocate_token_bitmask",
    "clear_padding_bits",
    "bitmask_width",
    "check_bitmask",
    "check_bitmask_rows",
    "unpack_bitmask",
    "pack_bool_mask",
    "allowed_token_ids",
    "apply_token_bitmask_inplace",
]


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words per row: ``ceil(vocab_size / 32)``."""
    return (int(vocab_size) + 31) // 32


def allocate_token_bitmask(
    rows: int, vocab_size: int, *, device: torch.device | str = "cpu", pin_memory: bool = False
) -> torch.Tensor:
    """A ``(rows, ceil(vocab_size/32))`` int32 bitmask filled with -1 (every token allowed).

    ``pin_memory=True`` gives page-locked host memory, so the host-to-device upload of a filled
    mask can be non-blocking.
    """
    if rows < 0 or vocab_size <= 0:
        raise BitmaskError(
            f"need rows >= 0 and vocab_size > 0, got rows={rows}, vocab_size={vocab_size}"
        )
    pin = pin_memory and torch.cuda.is_available()
    return torch.full(
        (rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, device=device, pin_memory=pin
    )


def check_bitmask(bitmask: torch.Tensor, vocab_size: int, row: int | None = None) -> None:
    """Raise :class:`BitmaskError` unless ``bitmask`` is a contiguous 2-D int32 CPU tensor of width
    ``ceil(vocab_size/32)`` (and ``row`` is in range)."""
    if not isinstance(bitmask, torch.Tensor):
        raise BitmaskError(f"bitmask must be a torch.Tensor, got {type(bitmask).__name__}")
    if bitmask.dtype != torch.int32:
        raise BitmaskError(f"bitmask dtype must be torch.int32, got {bitmask.dtype}")
    if bitmask.dim() != 2:
        raise BitmaskError(f"bitmask must be 2-D (rows, words), got shape {tuple(bitmask.shape)}")
    width = bitmask_width(vocab_size)
    if bitmask.shape[1] != width:
        raise BitmaskError(
            f"bitmask has {bitmask.shape[1]} words per row, expected ceil({vocab_size}/32) = {width}"
        )
    if bitmask.device.type != "cpu":
        raise BitmaskError(f"grammar fills write host memory; bitmask is on {bitmask.device}")
    if not bitmask.is_contiguous():
        raise BitmaskError("bitmask must be contiguous")
    if row is not None and not 0 <= row < bitmask.shape[0]:
        raise BitmaskError(f"row {row} is out of range for a bitmask with {bitmask.shape[0]} rows")


def check_bitmask_rows(bitmask: torch.Tensor, start: int, count: int) -> None:
    """Raise :class:`BitmaskError` unless rows ``[start, start + count)`` lie in ``bitmask``
    (``(rows, W)``, already checked by :func:`check_bitmask`)."""
    if not 0 <= start <= bitmask.shape[0] - count:
        raise BitmaskError(
            f"rows [{start}, {start + count}) do not fit a bitmask with {bitmask.shape[0]} rows"
        )


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Dense bool view: ``(rows, W)`` int32 -> ``(rows, vocab_size or 32*W)`` bool, True = allowed.
    Returned on the bitmask's device."""
    if bitmask.device.type == "cpu":
        words = np.ascontiguousarray(bitmask.numpy()).astype("<i4", copy=False)
        dense = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little").astype(bool)
        out = torch.from_numpy(dense)
    else:
        shifts = _BIT_SHIFTS.to(bitmask.device)
        out = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)
    return out if vocab_size is None else out[..., :vocab_size]


def pack_bool_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_bitmask`: ``(rows, V)`` bool -> ``(rows, ceil(V/32))`` int32 (CPU)."""
    rows, v = allowed.shape
    dense = np.zeros((rows, bitmask_width(v) * 32), dtype=bool)
    dense[:, :v] = allowed.cpu().numpy()
    packed = np.packbits(dense, axis=-1, bitorder="little").view("<i4")
    return torch.from_numpy(packed.astype(np.int32))


def clear_padding_bits(
    bitmask: torch.Tensor, start: int, stop: int, tokenizer_vocab_size: int
) -> None:
    """Zero the bits of ids ``>= tokenizer_vocab_size`` in rows ``[start, stop)`` (padding
    columns of the logits are never allowed in a constrained row)."""
    width = bitmask.shape[1]
    if tokenizer_vocab_size >= width * 32 or stop <= start:
        return
    word, bit = divmod(tokenizer_vocab_size, 32)
    # on the CPU through numpy: a small torch op starts an OpenMP region, which from many fill
    # threads at once cost ~100x the write itself
    rows = bitmask[start:stop].numpy() if bitmask.device.type == "cpu" else bitmask[start:stop]
    if bit:
        keep = (1 << bit) - 1  # low `bit` bits, below 2**31 so it fits int32
        rows[:, word] &= keep
        word += 1
    rows[:, word:] = 0


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int | None = None) -> list[int]:
    """Sorted token ids whose bit is set in one ``(W,)`` int32 row."""
    dense = unpack_bitmask(bitmask_row.unsqueeze(0), vocab_size)[0]
    return dense.nonzero().flatten().tolist()


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, *, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed logits to ``-inf`` in place.

    Args:
        logits: ``(rows, V)`` float32 / float16 / bfloat16, CPU or CUDA. ``V`` may differ from
            ``32 * W``: columns past the mask are disallowed, mask bits past ``V`` are ignored.
        bitmask: ``(rows, W)`` int32, or ``(len(indices), W)`` when ``indices`` is given; on the
            same device as ``logits``.
        indices: logits rows to mask (row ``indices[i]`` uses bitmask row ``i``); ``None`` = all.

    Raises :class:`BitmaskError` on a shape, dtype or device mismatch. Dispatches to the
    device's kernel in :mod:`spec_grammar.kernels`.
    """
    from .kernels import apply_token_bitmask_inplace as _dispatch

    _dispatch(logits, bitmask, indices=indices)
