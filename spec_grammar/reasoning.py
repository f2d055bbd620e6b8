"""Grammars that start mid-output: free reasoning text, then the grammar.

:class:`ReasoningGrammar` wraps any backend's :class:`~spec_grammar.protocol.SpecGrammar`. Tokens
up to and including the reasoning end marker (``</think>``, text or token ids, possibly several
tokens long) are free; the wrapped matcher sees only the tokens after it. Because the wrapper is
itself a ``SpecGrammar``, a draft tree whose nodes straddle the marker gets free rows above the
marker and the grammar's rows below it (bonus row included), and ``rollback`` across the
boundary restores reasoning mode: the tree fill, the verify and the drafters need no special
case. SGLang's ``ReasonerGrammarObject`` does the same for one token id; this one finds a
marker of any length by bytes, so it is found however the model spells it in tokens, split
across tokens and across draft-tree nodes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from .errors import GrammarSpecError, GrammarStateError
from .protocol import SpecGrammar
from .tokenizer_info import TokenizerInfo
from .tree import DraftTree
from .vocab import encode_ids

__all__ = ["ReasoningGrammar", "resolve_marker", "reasoning_token_count"]

_TREE_DEPTH_MARGIN = 64


def resolve_marker(info: TokenizerInfo, end_marker: str | Sequence[int]) -> tuple[bytes, list[int]]:
    """The marker's bytes and the token ids that spell it (text is encoded with the tokenizer).

    Raises :class:`GrammarSpecError` for an empty marker, ids outside the tokenizer or ids that
    do not spell the text."""
    if isinstance(end_marker, str):
        marker = end_marker.encode()
        ids = encode_ids(info.hf_tokenizer, end_marker) if end_marker else []
    else:
        ids = [int(t) for t in end_marker]
        bad = [t for t in ids if not 0 <= t < info.tokenizer_vocab_size]
        if bad:
            raise GrammarSpecError(f"reasoning end marker token ids out of range: {bad}")
        marker = b"".join(info.token_bytes[t] for t in ids)
    if not marker:
        raise GrammarSpecError("the reasoning end marker is empty")
    if set(ids) & set(info.stop_token_ids):
        raise GrammarSpecError(
            f"the reasoning end marker {marker!r} holds a stop token (stop tokens end the output)"
        )
    if b"".join(info.token_bytes[t] for t in ids) != marker:
        raise GrammarSpecError(
            f"the tokenizer does not spell the reasoning end marker {marker!r} with {ids}: "
            "pass its token ids"
        )
    return marker, ids


def marker_step(tail: bytes, piece: bytes, marker: bytes) -> tuple[bytes, bool]:
    """One token of text against ``marker``: (the new tail, the last ``len(marker) - 1`` bytes,
    all a later match needs; whether the text now ends with the marker). ``tail`` is the
    previous step's tail (``b""`` at the start)."""
    text = tail + piece
    keep = len(marker) - 1
    return (text[-keep:] if keep else b""), text.endswith(marker)


def reasoning_token_count(
    info: TokenizerInfo, token_ids: Sequence[int], marker: bytes
) -> int | None:
    """How many of ``token_ids`` are reasoning (marker included): the first token boundary
    where the text so far ends with ``marker``, as :class:`ReasoningGrammar` finds it; None when
    the marker never ends at a boundary."""
    tail = b""
    for n, t in enumerate(token_ids, 1):
        piece = info.token_bytes[t] if 0 <= t < info.tokenizer_vocab_size else b""
        tail, ended = marker_step(tail, piece, marker)
        if ended:
            return n
    return None


class ReasoningGrammar(SpecGrammar):
    """Free text until the reasoning end marker, then ``inner``'s grammar.

    Args:
        inner: a fresh matcher (nothing accepted yet) of the grammar that applies after the
            marker; the wrapper owns it from now on.
        end_marker: the marker as text (``"</think>"``) or as token ids. It is found in the
            bytes of the reasoning tokens when it ends at a token boundary; a token that holds
            the marker followed by more text does not end reasoning (the grammar would not see
            that text).
        max_reasoning_tokens: reasoning budget; once that many reasoning tokens have been
            accepted without the marker, the marker's tokens are forced (each row allows only
            the next one). ``None``: no budget.

    During reasoning every token of the tokenizer is allowed except the stop tokens (an output
    that stopped before the marker could not satisfy the grammar). Rows are ``(rows, ceil(V /
    32))`` int32 token bitmasks, as everywhere.

    Raises :class:`GrammarSpecError` for an empty marker, a marker whose token ids are out of
    range or do not spell it, a budget < 0, or an ``inner`` matcher that has accepted tokens.
    """

    def __init__(
        self,
        inner: SpecGrammar,
        end_marker: str | Sequence[int],
        *,
        max_reasoning_tokens: int | None = None,
    ):
        super().__init__(inner.info, max_rollback_tokens=inner.max_rollback_tokens)
        if inner.num_accepted:
            raise GrammarSpecError("ReasoningGrammar needs a fresh inner matcher")
        marker, ids = resolve_marker(inner.info, end_marker)
        if max_reasoning_tokens is not None and (
            isinstance(max_reasoning_tokens, bool)
            or not hasattr(max_reasoning_tokens, "__index__")
            or max_reasoning_tokens < 0
        ):
            raise GrammarSpecError(
                f"max_reasoning_tokens must be None or an int >= 0, got {max_reasoning_tokens!r}"
            )
        self.inner = inner
        self.end_marker = marker
        self.end_marker_ids = tuple(ids)
        self.max_reasoning_tokens = (
            None if max_reasoning_tokens is None else int(max_reasoning_tokens)
        )
        self._num_reasoning = 0  # reasoning tokens accepted, marker included
        self._done = False  # the marker has been accepted: the grammar applies
        # The last len(marker) - 1 bytes of reasoning text (all the marker match needs), and
        # their values before each of the last max_rollback_tokens reasoning tokens.
        self._tail = b""
        # (+ a margin: the tree fill undoes a branch token by token through the hook, however
        # small max_rollback_tokens is)
        self._tails: deque[bytes] = deque(maxlen=self.max_rollback_tokens + _TREE_DEPTH_MARGIN)

    @property
    def reasoning_length(self) -> int | None:
        """Tokens of reasoning, marker included, once the marker was accepted; else None."""
        return self._num_reasoning if self._done else None

    @property
    def in_reasoning(self) -> bool:
        """True while the marker has not been accepted (rows are free)."""
        return not self._done

    def _forced_marker_pos(self) -> int | None:
        """Index in ``end_marker_ids`` of the token the budget forces now, or None."""
        budget = self.max_reasoning_tokens
        if budget is None or self._num_reasoning < budget:
            return None
        return min(self._num_reasoning - budget, len(self.end_marker_ids) - 1)

    # -- hooks ----------------------------------------------------------------------------
    def _accept_token(self, token: int) -> bool:
        if self._done:
            return self.inner.accept_token(token)
        if token in self._stop_ids:
            return False
        pos = self._forced_marker_pos()
        if pos is not None and token != self.end_marker_ids[pos]:
            return False
        self._tails.append(self._tail)
        self._tail, self._done = marker_step(
            self._tail, self.info.token_bytes[token], self.end_marker
        )
        self._num_reasoning += 1
        return True

    def _accept_tokens(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and not self._done:
            if not self._accept_token(tokens[n]):
                return n
            n += 1
        return n + (self.inner.accept_tokens(tokens[n:]) if n < len(tokens) else 0)

    def _validate_tokens(self, tokens: list[int]) -> int:
        return self._fork()._accept_tokens(tokens)

    def _rollback(self, num_tokens: int) -> None:
        in_grammar = min(num_tokens, self.inner.num_accepted) if self._done else 0
        k = num_tokens - in_grammar  # reasoning tokens to undo
        if k > len(self._tails):  # checked first: nothing changes on a refused rollback
            raise GrammarStateError(
                f"rollback({num_tokens}) reaches past the reasoning state kept "
                "(max_rollback_tokens + a draft-tree depth margin)"
            )
        if in_grammar:
            self.inner.rollback(in_grammar)
        if k:
            self._done = False
        for _ in range(k):
            self._tail = self._tails.pop()
        self._num_reasoning -= k

    def _fork(self) -> ReasoningGrammar:
        child = object.__new__(ReasoningGrammar)
        child.__dict__.update(self.__dict__)
        child.inner = self.inner.fork()
        child._tails = self._tails.copy()
        return child

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._done:
            self.inner.fill_next_token_bitmask(bitmask, row)
            return
        pos = self._forced_marker_pos()
        words = bitmask.numpy()[row].view(np.uint32)
        if pos is not None:
            t = self.end_marker_ids[pos]
            words[:] = 0
            words[t >> 5] = np.uint32(1 << (t & 31))
            return
        words[:] = 0xFFFFFFFF  # padding ids are cleared by the public method
        for t in self._stop_ids:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def _is_terminated(self) -> bool:
        return self._done and self.inner.is_terminated()

    def _forced_tokens(self) -> list[int]:
        if self._done:
            return self.inner.forced_tokens()
        pos = self._forced_marker_pos()
        if pos is None:
            return []
        forced, tail = [], self._tail  # up to the token that completes the marker
        for t in self.end_marker_ids[pos:]:
            forced.append(t)
            tail, ended = marker_step(tail, self.info.token_bytes[t], self.end_marker)
            if ended:
                break
        return forced

    def _fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        if self._done:  # the whole tree is the grammar's: the backend's own (native) fill
            return self.inner.fill_tree_bitmask(tree, bitmask, row_offset)
        return super()._fill_tree_bitmask(tree, bitmask, row_offset)
