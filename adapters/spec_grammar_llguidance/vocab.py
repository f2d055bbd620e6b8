"""llguidance's view of the tokenizer: the ``LLTokenizer`` and an index of token bytes.

llguidance tokenizes forced text to pick the one token its mask allows there, so it needs an
``encode`` that spells text back exactly. :func:`llg_tokenizer` checks that on a sample of the
vocabulary and otherwise hands llguidance :class:`GreedyEncoder` (a vocabulary without byte
tokens, or a normalizer that rewrites text, would leave it with no allowed token at all).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from copy import copy
from typing import Any

import llguidance

from spec_grammar.tokenizer_info import TokenizerInfo
from spec_grammar.vocab import encode_ids, rust_tokenizer

__all__ = ["GreedyEncoder", "VocabIndex", "llg_tokenizer"]

_ROUND_TRIP_SAMPLE = 512


class GreedyEncoder:
    """Tokenizer for ``llguidance.TokenizerWrapper``: the Hugging Face encoding when it spells
    the input back exactly, else a greedy longest match over the vocabulary's bytes (a byte no
    token spells is skipped). Called with ``bytes``, returns token ids."""

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
        ids = encode_ids(self._hf, text.decode("utf-8", errors="replace"))
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


def tokenizer_json(tokenizer: Any) -> str:
    """The Rust tokenizer behind ``tokenizer`` (a fast ``transformers`` tokenizer or a
    ``tokenizers.Tokenizer``) serialized as ``tokenizer.json`` text, with padding and truncation
    off, exactly as ``llguidance.hf.from_tokenizer`` builds it (that module imports
    ``transformers``, which a base install does not have).

    Raises ``ValueError`` for a slow tokenizer (no Rust tokenizer behind it).
    """
    rust = rust_tokenizer(tokenizer)
    if rust is None:
        raise ValueError("Only fast tokenizers are supported")
    rust = copy(rust)  # the switches below would otherwise change the caller's tokenizer
    rust.no_padding()
    rust.no_truncation()
    return rust.to_str()


def llg_tokenizer(info: TokenizerInfo, slices: list[str] | None) -> Any:
    """``llguidance.LLTokenizer`` for ``info`` (stop tokens = llguidance's EOS tokens, width =
    ``info.vocab_size``) from the tokenizer's JSON (:func:`tokenizer_json`), or the same
    vocabulary through :class:`GreedyEncoder` when encoding a sample of token texts does not
    spell them back.

    Raises ``ValueError`` for a tokenizer that is not a fast Hugging Face tokenizer.
    """
    stops = list(info.stop_token_ids)
    lt = llguidance.LLTokenizer(
        tokenizer_json(info.hf_tokenizer), n_vocab=info.vocab_size, eos_token=stops, slices=slices
    )
    n = info.tokenizer_vocab_size
    sample = [
        t for t in range(0, n, max(1, n // _ROUND_TRIP_SAMPLE)) if t not in info.special_token_ids
    ]
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
        pairs = sorted((b, t) for t, b in enumerate(info.token_bytes) if b and t not in specials)
        self._keys = [b for b, _ in pairs]
        self._ids = [t for _, t in pairs]
        self._by_bytes: dict[bytes, list[int]] = {}  # for proper_prefixes: one lookup a length
        for b, t in pairs:
            self._by_bytes.setdefault(b, []).append(t)
        self.max_token_bytes = max((len(b) for b in self._keys), default=1)
        """Bytes of the longest token."""

    def _end(self, prefix: bytes, lo: int = 0) -> int:
        """Index past the last key starting with ``prefix`` (keys are sorted)."""
        stripped = prefix.rstrip(b"\xff")
        if not stripped:
            return len(self._keys)
        return bisect_left(self._keys, stripped[:-1] + bytes([stripped[-1] + 1]), lo)

    def starting_with(self, prefix: bytes) -> list[tuple[int, bytes]]:
        """``(token, bytes)`` of the tokens whose bytes start with ``prefix``, in byte order."""
        i = bisect_left(self._keys, prefix)
        end = self._end(prefix, i)
        return list(zip(self._ids[i:end], self._keys[i:end]))

    def extensions_accepted(self, prefix: bytes, accepts: Callable[[int], bool]) -> list[int]:
        """Tokens whose bytes start with ``prefix`` and that ``accepts`` takes, for a prefix-closed
        ``accepts`` (refusing a token refuses every token extending it): the extensions of a
        refused token are skipped unchecked, so the cost follows the accepted tokens plus one
        refused token per pruned block rather than the number of candidates."""
        out = []
        i = bisect_left(self._keys, prefix)
        end = self._end(prefix, i)
        while i < end:
            t = self._ids[i]
            if accepts(t):
                out.append(t)
                i += 1
            else:
                i = self._end(self._keys[i], i + 1)
        return out

    def proper_prefixes(self, text: bytes) -> list[int]:
        """Tokens whose bytes are a non-empty proper prefix of ``text`` (shorter first)."""
        out: list[int] = []
        get = self._by_bytes.get
        for k in range(1, min(len(text), self.max_token_bytes + 1)):
            ids = get(text[:k])
            if ids:
                out += ids
        return out
