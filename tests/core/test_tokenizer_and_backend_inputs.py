"""Odd tokenizers and bad arguments at the core's doors: ``TokenizerInfo.from_huggingface``
(both tokenizer kinds: SentencePiece-style vocabularies, added tokens, vocabulary holes, stop
ids of the wrong type or out of range), ``spec_grammar.vocab``'s token bytes, and the
``GrammarBackend`` constructor's compile limits.

Oracles: a token's bytes are what the tokenizer spells, so the bytes of an encoding, joined,
are the encoded text (with the SentencePiece leading space); a bad argument is a ``ValueError``
naming it at construction, never a compile error of a valid grammar later."""

from __future__ import annotations

import math

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from spec_grammar import GrammarCompileError, Regex, allocate_token_bitmask, get_backend
from spec_grammar.tokenizer_info import TokenizerInfo
from spec_grammar.vocab import token_bytes_table, tokenizer_len

TEXTS = ["ab abc", "é{x}", "zz😀", '{"a": "b"}', "a<tool>b", "two  spaces"]


def byte_pieces() -> dict[str, int]:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    return vocab


def sp_bpe() -> Tokenizer:
    """Llama-2 style: BPE over ``▁``-joined pieces with byte fallback, plus a special added
    token and a plain added one."""
    vocab = byte_pieces()
    for p in ["▁", "a", "b", "c", "▁a", "▁ab", "ab", "é", "▁é", "{", "}", '"', ":", "▁{"]:
        vocab[p] = len(vocab)
    merges = [("▁", "a"), ("▁a", "b"), ("a", "b"), ("▁", "é"), ("▁", "{")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return tok


def sp_unigram() -> Tokenizer:
    """Gemma / T5 style: Unigram with byte fallback and a Metaspace decoder."""
    pieces = [(p, -10.0) for p in byte_pieces()]
    pieces += [(p, -1.0) for p in ["▁", "a", "b", "▁a", "▁ab", "é", "▁é", "{", "}", "▁two"]]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    # "first": a leading space on the text only ("always" also adds one after an added token)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return tok


@pytest.mark.parametrize("build", [sp_bpe, sp_unigram])
def test_sentencepiece_style_token_bytes_spell_the_text(build):
    tok = build()
    info = TokenizerInfo.from_huggingface(tok, stop_token_ids=[2])
    end = tok.token_to_id("<|end|>")
    assert end in info.special_token_ids and tok.token_to_id("<tool>") not in info.special_token_ids
    assert info.token_bytes[end] == b"<|end|>" and info.token_bytes[3 + 0x41] == b"A"
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert b"".join(info.token_bytes[i] for i in ids) == (" " + text).encode(), text


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_backends_on_a_sentencepiece_plain_tokenizer_allow_what_the_bytes_spell(name):
    """Rows of a plain SentencePiece tokenizer: at the start of ``ab( ab)*`` exactly the tokens
    whose bytes are a prefix of a match (the leading-space pieces are not); after ``a``, ``b``.
    (xgrammar refused a plain tokenizer: "Unsupported tokenizer type".)"""
    pytest.importorskip(f"spec_grammar_{name}")
    tok = sp_bpe()
    backend = get_backend(name, tok, stop_token_ids=[2])
    table = backend.tokenizer_info.token_bytes
    m = backend.matcher(backend.compile(Regex("ab( ab)*")))
    bm = allocate_token_bitmask(1, backend.vocab_size)

    def allowed():
        m.fill_next_token_bitmask(bm)
        return {i for i in range(backend.vocab_size) if (int(bm[0, i // 32]) >> (i % 32)) & 1}

    assert allowed() == {i for i, b in enumerate(table) if b in (b"a", b"ab")}
    assert m.accept_token(tok.token_to_id("a"))
    assert allowed() == {i for i, b in enumerate(table) if b == b"b"}


def test_a_sentencepiece_decoder_without_byte_fallback_keeps_the_spaces():
    """A Replace("▁", " ") + Strip decoder (SentencePiece without byte fallback): the "▁" test
    of the decoder kind ran on ASCII-escaped JSON and never matched, so each piece went
    through the decoder alone and its Strip dropped the space: "ab ab" was spelled b"abab"."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "▁ab": 5, "ab": 6}
    tok = Tokenizer(models.BPE(vocab, [("▁", "a"), ("▁a", "b"), ("a", "b")], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    table = token_bytes_table(tok)
    assert table[1] == b" " and table[5] == b" ab" and table[6] == b"ab"
    ids = tok.encode("ab ab").ids
    assert b"".join(table[i] for i in ids) == b" ab ab"


def holes() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 5, "<eos>": 9}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_a_vocabulary_with_holes_keeps_every_token():
    """Both tokenizer kinds count tokens (3 here), not ids: ids 5 and 9 were cut off, their
    bytes lost, and the EOS 9 refused as "outside the vocabulary [0, 3)"."""
    from transformers import PreTrainedTokenizerFast

    plain = holes()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=holes(), eos_token="<eos>")
    for tok, kw in [(plain, dict(stop_token_ids=[9])), (wrapped, {})]:
        assert tokenizer_len(tok) == 10
        info = TokenizerInfo.from_huggingface(tok, **kw)
        assert info.tokenizer_vocab_size == 10 and info.stop_token_ids == (9,)
        assert info.token_bytes == [b"a", b"", b"", b"", b"", b"b", b"", b"", b"", b"<eos>"]
        assert token_bytes_table(tok) == info.token_bytes
    backend = get_backend("xgrammar", wrapped)
    m = backend.matcher(backend.compile(Regex("(ab)+")))
    assert m.accept_token(0) and m.accept_token(5) and m.accept_token(9) and m.is_terminated()


@pytest.mark.parametrize(
    "stops, error, message",
    [
        ([], ValueError, "stop_token_ids is empty"),
        (["2"], ValueError, "stop token id must be an integer, got str '2'"),
        ([2.7], ValueError, "stop token id must be an integer, got float 2.7"),
        ([True], ValueError, "stop token id must be an integer, got bool"),
        ([-1], ValueError, r"stop token id -1 is outside the vocabulary \[0, "),
        ([10**6], ValueError, r"stop token id 1000000 is outside the vocabulary"),
        ("2", TypeError, "stop_token_ids must be a sequence of token ids, got str"),
        (2.0, TypeError, "stop_token_ids must be a sequence of token ids, got float"),
    ],
)
def test_bad_stop_token_ids_are_named(stops, error, message):
    """``["2"]``, ``[2.7]`` and ``[True]`` were read as 2, 2 and 1; ``[]`` gave a backend with
    no stop token (a grammar request could never end on one; llguidance and outlines take the
    first stop id and failed with an IndexError)."""
    with pytest.raises(error, match=message):
        TokenizerInfo.from_huggingface(sp_bpe(), stop_token_ids=stops)


def test_one_stop_id_may_be_given_bare():
    """As ``eos_token_id`` may be: ``stop_token_ids=2`` was ``'int' object is not iterable``."""
    assert TokenizerInfo.from_huggingface(sp_bpe(), stop_token_ids=2).stop_token_ids == (2,)


@pytest.mark.parametrize("width", ["300", 2.5, True, None.__class__])
def test_vocab_size_must_be_an_int(width):
    with pytest.raises(ValueError, match="vocab_size must be an integer"):
        TokenizerInfo.from_huggingface(sp_bpe(), stop_token_ids=[2], vocab_size=width)


# -- the backend's compile limits ---------------------------------------------------------------
@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "5", True])
def test_a_bad_compile_timeout_is_refused_at_construction(tok, timeout):
    """It used to fail every compile instead, and cache the failure: 0, -1 and NaN as a
    timeout, ``"5"`` as "regex failed to compile: TypeError ..." of a valid grammar."""
    with pytest.raises(ValueError, match="compile_timeout_s must be None or a number of seconds"):
        get_backend("xgrammar", tok, compile_timeout_s=timeout)


def test_an_infinite_compile_timeout_waits_for_ever(tok):
    """``inf`` failed every compile with "OverflowError: timestamp out of range"."""
    backend = get_backend("xgrammar", tok, compile_timeout_s=math.inf)
    assert backend.compile_timeout_s is None
    assert backend.compile(Regex("a+")).native is not None
    assert get_backend("xgrammar", tok, compile_timeout_s=2).compile_timeout_s == 2


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("compile_cache_size", 2.5, "compile_cache_size must be an integer, got float"),
        ("compile_cache_size", None, "compile_cache_size must be an integer"),
        ("compile_cache_size", -1, "compile_cache_size must be >= 0"),
        ("max_grammar_bytes", float("nan"), "max_grammar_bytes must be an integer"),
        ("max_grammar_bytes", None, "max_grammar_bytes must be an integer"),
        ("max_grammar_bytes", 0, "max_grammar_bytes must be >= 1"),
        ("max_grammar_bytes", -1, "max_grammar_bytes must be >= 1"),
    ],
)
def test_bad_compile_limits_are_named(tok, option, value, message):
    """``max_grammar_bytes=-1`` refused every spec at compile time as "over
    max_grammar_bytes=-1"; NaN / None failed with ``int()``'s message, which names nothing."""
    with pytest.raises(ValueError, match=message):
        get_backend("xgrammar", tok, **{option: value})


def test_valid_limits_still_compile(tok):
    backend = get_backend("xgrammar", tok, compile_cache_size=0, max_grammar_bytes=100)
    assert backend.compile(Regex("a+")).native is not None
    with pytest.raises(GrammarCompileError, match="over max_grammar_bytes=100"):
        backend.compile(Regex("a" * 200))
