"""Fixture tokenizers and grammars of the conformance suite.

The toy tokenizer is the one of ``conformance-cases.md``: 20 ids, logits width 32 (ids 20..31
are padding), built as a real Hugging Face fast tokenizer (a ``tokenizers`` BPE model over
byte-level pieces, with GPT-2's ``ByteLevel`` decoder), so every library reads it through its
ordinary Hugging Face path. Grammar **G** is a small JSON-like object, **U** repeats the
two-byte ``é`` (``C3 A9``), which the vocabulary also has as single-byte tokens.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..specs import Ebnf, GrammarSpec, Lark, Regex

__all__ = [
    "TOY_TOKEN_BYTES",
    "TOY_WIDTH",
    "EOS",
    "toy_tokenizer",
    "fixture_tokenizer",
    "SMOLLM2_PADDING",
    "grammar_g",
    "grammar_u",
]

EOS = 0
TOY_WIDTH = 32
TOY_TOKEN_BYTES: tuple[bytes, ...] = (
    b"<eos>",  # 0, special, the stop token
    b"{",
    b"}",
    b'"a"',
    b'"b"',
    b":",  # 5
    b",",
    b"1",
    b"2",
    b" ",
    b"x",  # 10
    b'{"a":',
    b"</think>",
    b"\n",
    b"```",
    b"\xc3",  # 15: first byte of e-acute
    b"\xa9",  # second byte of e-acute
    b"\xa8",  # second byte of e-grave
    b',"c"',
    "\u00e9".encode(),  # 19: e-acute, C3 A9
)
"""``TOY_TOKEN_BYTES[i]``: the bytes token ``i`` stands for."""

SMOLLM2_PADDING = 64
"""Padding columns added to SmolLM2's logits width in the suite, so ``[len(tokenizer), V)``
is not empty on the real tokenizer either."""


@lru_cache(maxsize=1)
def toy_tokenizer() -> Any:
    """The toy tokenizer: a ``transformers`` fast tokenizer of 20 tokens, EOS = ``<eos>`` (0).

    Decoding follows GPT-2's byte-level scheme, so raw bytes ``0xC3``, ``0xA9``, ``0xA8`` are
    tokens of their own. No merges: encoding produces single-byte pieces where no whole token
    matches (only decoding matters to grammar engines).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ..vocab import _byte_decoder

    to_unicode = {b: ch for ch, b in _byte_decoder().items()}
    vocab = {"<eos>": EOS}
    for i, raw in enumerate(TOY_TOKEN_BYTES[1:], start=1):
        vocab["".join(to_unicode[b] for b in raw)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def fixture_tokenizer(name: str) -> tuple[Any, int]:
    """``(hf_tokenizer, logits_width)`` of fixture ``"toy"`` (width 32) or ``"smollm2"``
    (``len(tokenizer) + SMOLLM2_PADDING``). Raises ``ValueError`` for another name."""
    if name == "toy":
        return toy_tokenizer(), TOY_WIDTH
    if name == "smollm2":
        from ..models import load_tokenizer

        tok = load_tokenizer("smollm2")
        return tok, len(tok) + SMOLLM2_PADDING
    raise ValueError(f"unknown fixture tokenizer {name!r}; use 'toy' or 'smollm2'")


_G_EBNF = r"""root ::= "{" "\"a\"" ":" int ( "," "\"b\"" ":" int )? "}"
int ::= [12]+
"""
_G_LARK = r"""start: "{" "\"a\"" ":" INT ("," "\"b\"" ":" INT)? "}"
INT: /[12]+/
"""


def grammar_g() -> list[GrammarSpec]:
    """Grammar G (``{"a":<int>(,"b":<int>)?}``, ``int ::= [12]+``, no whitespace) in every
    spec kind that can express it: Regex, Ebnf, Lark."""
    return [Regex(r'\{"a":[12]+(,"b":[12]+)?\}'), Ebnf(_G_EBNF), Lark(_G_LARK)]


def grammar_u() -> list[GrammarSpec]:
    """Grammar U (one or more ``é``) as Regex, Ebnf and Lark."""
    return [Regex("\u00e9+"), Ebnf('root ::= "\u00e9"+\n'), Lark('start: "\u00e9"+\n')]
