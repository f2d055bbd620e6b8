"""llguidance's view of the tokenizer: the ``LLTokenizer`` and an index of token bytes.

llguidance tokenizes forced text to pick the one token its mask allows there, so it needs an
``encode`` that spells text back exactly. :func:`llg_tokenizer` checks that on a sample of the
vocabulary and otherwise hands llguidance :class:`GreedyEncoder` (a vocabulary without byte
tokens, or a normalizer that rewrites text, would leave it with no allowed token at all).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import llguidance
import llguidance.hf

from spec_grammar.protocol import TokenizerInfo

__all__ = ["GreedyEncoder", "VocabIndex", "llg_tokenizer"]

_ROUND_TRIP_SAMPLE = 512


class GreedyEncoder:
    """Tokenizer for ``llguidance.TokenizerWrapper``: the Hugging Face encoding when it spells
    the input back exactly, else a greedy longest match over the vocabulary's bytes (a byte no
    token spells is skipped)."""

    def __init__(self, info: TokenizerInfo):
        self._hf = info.hf_tokenizer
        self.eos_token_id = info.stop_token_ids[0]
        self.bos_token_id = getattr(self._hf, "bos_token_id", None)
        self.tokens = list(info.token_bytes)
        self.special_token_ids = sorted(t for t in info.special_token_ids if t < len(self.tokens))
        specials = set(self.special_token_ids)
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b and i not in specials:
                self._ids.setdefault(b, i)
        self._longest = max((len(b) for b in self._ids), default=1)

    def __call__(self, text: bytes) -> list[int]:
        ids = self._hf.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)
        if b"".join(self.tokens[i] for i in ids if i < len(self.tokens)) == text:
            return ids
        out, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                t = self._ids.get(text[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                i += 1
        return out


def llg_tokenizer(info: TokenizerInfo, slices: list[str] | None) -> Any:
    """``llguidance.LLTokenizer`` for ``info`` (stop tokens = llguidance's EOS tokens, width =
    ``info.vocab_size``): llguidance's own Hugging Face path, or the same vocabulary through
    :class:`GreedyEncoder` when encoding a sample of token texts does not spell them back.

    Raises ``ValueError`` for a tokenizer that is not a fast Hugging Face tokenizer.
    """
    stops = list(info.stop_token_ids)
    lt = llguidance.hf.from_tokenizer(info.hf_tokenizer, n_vocab=info.vocab_size, eos_token=stops, slices=slices)
    n = info.tokenizer_vocab_size
    sample = [t for t in range(0, n, max(1, n // _ROUND_TRIP_SAMPLE)) if t not in info.special_token_ids]
    texts = [lt.decode_bytes([t]) for t in sample]
    if all(lt.decode_bytes(lt.tokenize_bytes(b)) == b for b in texts):
        return lt
    wrapper = llguidance.TokenizerWrapper(GreedyEncoder(info))
    return llguidance.LLTokenizer(wrapper, n_vocab=info.vocab_size, eos_token=stops, slices=slices)


class VocabIndex:
    """Non-special tokens sorted by their bytes, for prefix queries (built once per backend;
    ~0.1 s for a 49k vocabulary)."""

    def __init__(self, info: TokenizerInfo):
        specials = info.special_token_ids
        pairs = sorted(
            (b, t) for t, b in enumerate(info.token_bytes) if b and t not in specials
        )
        self._keys = [b for b, _ in pairs]
        self._ids = [t for _, t in pairs]

    def starting_with(self, prefix: bytes) -> list[int]:
        """Tokens whose bytes start with ``prefix`` (``prefix`` itself included)."""
        out = []
        i = bisect_left(self._keys, prefix)
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            out.append(self._ids[i])
            i += 1
        return out

    def exactly(self, text: bytes) -> list[int]:
        """Tokens whose bytes are exactly ``text``."""
        out = []
        i = bisect_left(self._keys, text)
        while i < len(self._keys) and self._keys[i] == text:
            out.append(self._ids[i])
            i += 1
        return out

    def spellings(self, forced: bytes) -> list[int]:
        """Tokens consistent with the forced text: their bytes are a prefix of ``forced`` or
        start with it."""
        out = [t for k in range(1, len(forced)) for t in self.exactly(forced[:k])]
        return out + self.starting_with(forced)
