"""Token-id -> bytes tables for Hugging Face tokenizers, and uniform access to the two kinds:
a ``transformers`` tokenizer or a plain ``tokenizers.Tokenizer`` (the Rust library, all a user
without ``transformers`` has).

Backends whose libraries take a raw byte vocabulary (outlines-core, third-party engines) build
it here. Two encodings cover the tokenizers in use:

- byte-level BPE (GPT-2, Llama-3, SmolLM2, Qwen): each byte is one printable unicode character
  (``bytes_to_unicode`` of GPT-2's ``encoder.py``), reversed here;
- SentencePiece style (Llama-2, Gemma): ``▁`` stands for a space and ``<0xNN>`` for a raw byte.

Added tokens (``<|im_end|>`` ...) map to their UTF-8 text.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

__all__ = [
    "is_rust_tokenizer",
    "rust_tokenizer",
    "tokenizer_len",
    "added_tokens",
    "encode_ids",
    "token_bytes_table",
]


def is_rust_tokenizer(tokenizer: Any) -> bool:
    """True for a plain ``tokenizers.Tokenizer`` (False when that library is not installed)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    return isinstance(tokenizer, Tokenizer)


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``: itself, a fast ``transformers``
    tokenizer's ``backend_tokenizer``, or None (a slow tokenizer)."""
    if is_rust_tokenizer(tokenizer):
        return tokenizer
    return getattr(tokenizer, "backend_tokenizer", None)


def tokenizer_len(tokenizer: Any) -> int:
    """Number of token ids, added tokens included: ``len(tokenizer)`` for ``transformers``,
    or past the largest id when the vocabulary has holes (both kinds count the tokens, so a
    vocabulary ``{"a": 0, "b": 5}`` has 2 tokens but ids up to 5)."""
    if is_rust_tokenizer(tokenizer):
        n = tokenizer.get_vocab_size(with_added_tokens=True)
    else:
        n = len(tokenizer)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    ids = get_vocab().values() if get_vocab is not None else ()
    return max(n, max(ids, default=-1) + 1)


def added_tokens(tokenizer: Any) -> dict[int, Any]:
    """Added tokens by id, each with ``.content`` (its text) and ``.special``."""
    if is_rust_tokenizer(tokenizer):
        return tokenizer.get_added_tokens_decoder()
    return getattr(tokenizer, "added_tokens_decoder", {})


def encode_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (no BOS)."""
    if is_rust_tokenizer(tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kind(tokenizer: Any) -> str:
    backend = rust_tokenizer(tokenizer)
    if backend is None:
        return "slow"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    # ensure_ascii=False: escaped, the "▁" of a Replace("▁", " ") decoder was never found, and a
    # SentencePiece vocabulary without byte fallback was read through its decoder piece by
    # piece (whose Strip drops each word's leading space: "▁ab" became b"ab")
    text = json.dumps(decoder, ensure_ascii=False)
    if '"ByteLevel"' in text:
        return "byte_level"
    if '"ByteFallback"' in text or "\u2581" in text or '"Metaspace"' in text:
        return "sentencepiece"
    return "slow"


def _decode_byte_level(piece: str) -> bytes:
    table = _byte_decoder()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:
        return piece.encode("utf-8")


def _decode_sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes_table(tokenizer: Any, size: int | None = None) -> list[bytes]:
    """``table[i]`` = the bytes token ``i`` stands for; ``size`` defaults to the number of ids
    (:func:`tokenizer_len`). ``tokenizer``: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``.

    Ids with no token (holes in the vocabulary) map to ``b""``.
    """
    n = tokenizer_len(tokenizer) if size is None else size
    kind = _decoder_kind(tokenizer)
    added = {int(i): t.content for i, t in added_tokens(tokenizer).items()}
    table = [b""] * n
    for piece, i in tokenizer.get_vocab().items():
        if not 0 <= i < n:
            continue
        if i in added:
            table[i] = added[i].encode("utf-8")
        elif kind == "byte_level":
            table[i] = _decode_byte_level(piece)
        elif kind == "sentencepiece":
            table[i] = _decode_sentencepiece(piece)
        else:
            table[i] = _piece_text(tokenizer, piece).encode("utf-8")
    return table


def _piece_text(tokenizer: Any, piece: str) -> str:
    if not is_rust_tokenizer(tokenizer):
        return tokenizer.convert_tokens_to_string([piece])
    # what a fast transformers tokenizer's convert_tokens_to_string does
    decoder = tokenizer.decoder
    return piece if decoder is None else decoder.decode([piece])
