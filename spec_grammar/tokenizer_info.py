"""What a backend knows about the tokenizer and the logits: :class:`TokenizerInfo`."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .bitmask import bitmask_width
from .vocab import added_tokens, is_rust_tokenizer, token_bytes_table, tokenizer_len

__all__ = ["TokenizerInfo"]


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and hasattr(value, "__index__")


def _as_id(value: Any, what: str) -> int:
    """``value`` as an exact int; ``ValueError`` naming ``what`` for a bool, a float or a string
    (``int()`` would read ``"2"`` as 2, truncate 2.7 and take True for 1)."""
    if not _is_int(value):
        raise ValueError(f"{what} must be an integer, got {type(value).__name__} {value!r:.40}")
    return operator.index(value)


@dataclass(eq=False)
class TokenizerInfo:
    """What a backend needs to know about the tokenizer and the logits.

    Attributes:
        hf_tokenizer: the Hugging Face tokenizer: a ``transformers`` tokenizer or a plain
            ``tokenizers.Tokenizer`` (:mod:`spec_grammar.vocab` reads both).
        vocab_size: logits width ``V`` (columns of the model's logits; may exceed the tokenizer).
        tokenizer_vocab_size: the tokenizer's number of ids (``len(tokenizer)``) capped at ``V``;
            ids in ``[tokenizer_vocab_size, V)`` are never allowed in a constrained row.
        stop_token_ids: tokens that end generation (EOS); allowed exactly where the grammar can end.
        special_token_ids: added/special tokens (never produced by a grammar, stop tokens aside).
    """

    hf_tokenizer: Any
    vocab_size: int
    tokenizer_vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_huggingface(
        cls,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> TokenizerInfo:
        """Build from a Hugging Face tokenizer: a ``transformers`` tokenizer, or a plain
        ``tokenizers.Tokenizer`` (which has no EOS of its own: pass ``stop_token_ids``).
        ``vocab_size`` = logits width (default: the tokenizer's number of ids, ``len(tokenizer)``);
        ``stop_token_ids`` default to the tokenizer's EOS id.

        ``stop_token_ids`` may be one id. Raises ``TypeError`` for an object that is not a
        tokenizer and ``ValueError`` when no stop token can be found (none given, or an empty
        list), or an id or ``vocab_size`` is not an int or out of range.
        """
        rust = is_rust_tokenizer(tokenizer)
        if not rust and not (hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "__len__")):
            raise TypeError(
                f"expected a Hugging Face tokenizer, got {type(tokenizer).__name__}"
                " (spec_grammar.models.load_tokenizer(name) loads one)"
            )
        n_tok = tokenizer_len(tokenizer)
        width = n_tok if vocab_size is None else _as_id(vocab_size, "vocab_size")
        if width <= 0:
            raise ValueError(f"vocab_size must be positive, got {width}")
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos)
        elif _is_int(stop_token_ids):  # one id, as eos_token_id may be
            stop_token_ids = [stop_token_ids]
        elif isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
            raise TypeError(
                f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__}"
            )
        stops = tuple(_as_id(t, "stop token id") for t in stop_token_ids)
        if not stops:
            raise ValueError("stop_token_ids is empty: a grammar needs a stop token to end on")
        for t in stops:
            if not 0 <= t < min(n_tok, width):
                raise ValueError(
                    f"stop token id {t} is outside the vocabulary [0, {min(n_tok, width)})"
                )
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        for i, tok in added_tokens(tokenizer).items():
            if getattr(tok, "special", False):
                specials.add(int(i))
        return cls(
            hf_tokenizer=tokenizer,
            vocab_size=width,
            tokenizer_vocab_size=min(n_tok, width),
            stop_token_ids=stops,
            special_token_ids=frozenset(specials),
        )

    @property
    def bitmask_width(self) -> int:
        """Int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return bitmask_width(self.vocab_size)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """``token_bytes[i]``: the bytes of token ``i`` for ``i < tokenizer_vocab_size``."""
        return token_bytes_table(self.hf_tokenizer, self.tokenizer_vocab_size)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the ids (invalid UTF-8 replaced); for error messages and reports."""
        return b"".join(
            self.token_bytes[t] if 0 <= t < self.tokenizer_vocab_size else b"" for t in token_ids
        ).decode("utf-8", errors="replace")
