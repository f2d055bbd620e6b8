"""Grammar rows for draft models whose vocabulary differs from the target's.

EAGLE-3 draft heads predict over a reduced "hot" vocabulary of ``V_d`` ids and ship a ``d2t``
map of offsets: draft id ``d`` is target id ``d + d2t[d]`` (the checkpoint convention that
SGLang loads as ``hot_token_id = d2t + arange(V_d)``). The grammar fills rows in TARGET
vocabulary space (``ceil(V_t / 32)`` words); masking the draft logits needs the same allowed
set in DRAFT space. :func:`draft_vocab_bitmask` translates; :func:`check_draft_vocab` refuses a
mismatched drafter without a map (a configuration error, never a silent wrong mask).
"""

from __future__ import annotations

import torch

from ...bitmask import pack_bool_mask, unpack_bitmask
from ...errors import SpecGrammarError

__all__ = ["DraftVocabError", "check_draft_vocab", "draft_vocab_bitmask", "draft_to_target_ids"]


class DraftVocabError(SpecGrammarError, ValueError):
    """The draft model's vocabulary differs from the target's and no valid ``d2t`` id map was
    given (or the map has the wrong length / points outside the target vocabulary)."""


def check_draft_vocab(
    draft_vocab_size: int, target_vocab_size: int, d2t: torch.Tensor | None
) -> None:
    """Raise :class:`DraftVocabError` unless draft ids can be read as target ids: equal widths
    and no map, or a ``(draft_vocab_size,)`` integer ``d2t`` whose targets lie in
    ``[0, target_vocab_size)``."""
    if d2t is None:
        if draft_vocab_size != target_vocab_size:
            raise DraftVocabError(
                f"the draft model predicts {draft_vocab_size} ids but the target has {target_vocab_size}: "
                "constrained drafting needs a d2t id map (EAGLE-3 style) to translate grammar rows"
            )
        return
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab_size or d2t.dtype.is_floating_point:
        raise DraftVocabError(
            f"d2t must be a 1-D integer tensor of length {draft_vocab_size}, got {d2t.dtype} {tuple(d2t.shape)}"
        )
    target = draft_to_target_ids(torch.arange(draft_vocab_size), d2t)
    if draft_vocab_size and not (0 <= int(target.min()) and int(target.max()) < target_vocab_size):
        raise DraftVocabError(
            f"d2t maps draft ids outside the target vocabulary [0, {target_vocab_size})"
        )


def draft_to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of ``draft_ids`` (any shape, int64): ``d + d2t[d]``."""
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


def draft_vocab_bitmask(
    target_rows: torch.Tensor, d2t: torch.Tensor, target_vocab_size: int
) -> torch.Tensor:
    """Translate grammar rows from target to draft vocabulary space.

    Args:
        target_rows: ``(R, ceil(V_t/32))`` int32 CPU bitmask in target space.
        d2t: ``(V_d,)`` int64 offsets, draft id ``d`` = target id ``d + d2t[d]``.
        target_vocab_size: ``V_t``.

    Returns ``(R, ceil(V_d/32))`` int32: draft id ``d`` allowed iff its target id is. Raises
    :class:`DraftVocabError` on a bad map.
    """
    v_d = int(d2t.shape[0]) if d2t.dim() == 1 else -1
    check_draft_vocab(v_d, target_vocab_size, d2t)
    dense = unpack_bitmask(target_rows, target_vocab_size)
    return pack_bool_mask(dense[:, draft_to_target_ids(torch.arange(v_d), d2t)])
