"""Issue 33's library faults, one test per fault and backend it applies to, against an oracle.

- Rows that disagree with accept (llguidance's row limit on wide objects): refused at compile
  with a typed :class:`GrammarLimitError`, or compiled with rows that agree
  (:func:`~spec_grammar.testing.row_properties.check_rows_agree`) and documents that parse.
- Raw control characters in length-bounded strings (xgrammar): no row inside such a string
  allows one; escapes count as one character (oracle: ``json.loads`` + ``jsonschema``).
- A greedy lexer refusing valid Lark text (llguidance): declared (``lexer:refuses``) and
  refused under strict; where not declared, the verdict equals ``re.fullmatch`` of the
  grammar's language written as a Python regex.
"""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
import pytest

from spec_grammar import get_backend
from spec_grammar.errors import GrammarLimitError, UnsupportedGrammarError
from spec_grammar.specs import JsonSchema, Lark
from spec_grammar.testing.core import allowed_set
from spec_grammar.testing.differential import Tokenizations, accepts, warned_keywords
from spec_grammar.testing.fixtures import fixture_tokenizer
from spec_grammar.testing.row_properties import check_rows_agree, flat_object

JSON_BACKENDS = ("xgrammar", "llguidance", "outlines")
LARK_BACKENDS = ("xgrammar", "llguidance")  # outlines-core takes regular grammars only


@cache
def backend(name: str, **options):
    tok, width = fixture_tokenizer("smollm2")
    return get_backend(name, tok, vocab_size=width, compile_timeout_s=60, **options)


def fresh_accepts(name: str, compiled, text: str) -> set[bool]:
    """Whether a fresh matcher accepts ``text`` + EOS, in each tokenization that spells it."""
    b = backend(name)
    t = Tokenizations(b.tokenizer_info)
    eos = b.tokenizer_info.stop_token_ids[0]
    spellings = [ids for ids in (t.canonical(text), t.chars(text)) if ids is not None]
    assert spellings, f"no tokenization spells {text!r}"
    return {accepts(b.matcher(compiled), ids, eos) for ids in spellings}


# -- rows that disagree with accept: llguidance's row limit ----------------------------------


@cache
def llguidance_raised():
    """llguidance with its Earley row limit raised past what 500 optional properties need."""
    tok, width = fixture_tokenizer("smollm2")
    limits = {"max_items_in_row": 20_000}
    return get_backend("llguidance", tok, vocab_size=width, parser_limits=limits)


@pytest.mark.parametrize("name", ("xgrammar", "llguidance"))
def test_wide_object_rows_agree_or_limit_error(name):
    """500 optional properties: llguidance 1.9.1 passes its default ``max_items_in_row`` at the
    first ``{`` (it compiled, then refused the token its row allowed): the compile must say so
    with a GrammarLimitError naming the knob; with the knob raised, rows agree with accept and
    a document the oracle validates is accepted. (outlines-core: its index for this schema is
    refused by size, a resource limit of its own.)"""
    schema = flat_object(500)
    spec = JsonSchema(schema)
    b = backend(name)
    if name == "llguidance":
        with pytest.raises(GrammarLimitError, match="max_items_in_row"):
            b.compile(spec)
        b = llguidance_raised()
    compiled = b.compile(spec)
    assert check_rows_agree(b, compiled, walks=1, steps=4, allowed_sample=48) >= 1
    text = json.dumps({"p3": "x", "p499": 7})
    jsonschema.validate(json.loads(text), schema)
    t = Tokenizations(b.tokenizer_info)
    assert accepts(b.matcher(compiled), t.canonical(text), b.tokenizer_info.stop_token_ids[0])


def test_llguidance_wide_object_out_of_the_probes_reach():
    """A wide object under an optional property: the first rows never reach it, so the
    compile reads the schema (``wide_object``); optional properties after a required one do not
    count (llguidance takes 499 of them there: a document is accepted)."""
    b = backend("llguidance")
    nested = {"type": "object", "properties": {"a": flat_object(500)}}
    with pytest.raises(GrammarLimitError, match="/properties/a has 500 optional"):
        b.compile(JsonSchema(nested))
    props = {f"r{i}": {"type": "string"} for i in range(2)} | flat_object(499)["properties"]
    after = {"type": "object", "properties": props, "required": ["r0", "r1"]}
    compiled = b.compile(JsonSchema(after))
    text = json.dumps({"r0": "x", "r1": "y", "p498": 3})
    jsonschema.validate(json.loads(text), after)
    assert fresh_accepts("llguidance", compiled, text) == {True}
    assert check_rows_agree(b, compiled, walks=1, steps=4, allowed_sample=16) >= 1


# -- raw control characters inside length-bounded strings ------------------------------------

BOUNDED = {
    "type": "object",
    "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}},
}


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_bounded_string_rows_have_no_raw_control_character(name):
    b = backend(name)
    compiled = b.compile(JsonSchema(BOUNDED))
    info = b.tokenizer_info
    m = b.matcher(compiled)
    prefix = info.hf_tokenizer.encode('{"s": "', add_special_tokens=False)
    assert m.accept_tokens(prefix) == len(prefix)
    for _ in range(2):  # inside the string: after the quote, then after one character
        raw = [t for t in allowed_set(m) if any(c < 0x20 for c in info.token_bytes[t])]
        assert not raw, f"{name}: raw control characters allowed in a JSON string: {raw[:5]}"
        assert m.accept_token(info.hf_tokenizer.encode("a", add_special_tokens=False)[0])


BOUNDED_TEXTS = [
    '{"s": "a"}',
    '{"s": "abc"}',
    '{"s": "abcd"}',
    '{"s": ""}',
    '{"s": "\\n\\t\\""}',  # three escapes: three characters
    '{"s": "\\u00e9\\u00e9"}',
    '{"s": "a\\\\bc"}',  # a backslash escape plus three: four characters
    '{"s": "a\tb"}',  # raw tab: not JSON
    '{"s": "\x01"}',  # raw U+0001: not JSON
]


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)  # strict: raw control characters in strings are refused
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(BOUNDED).is_valid(value)


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_bounded_strings_follow_json_and_count_escapes_as_one(name):
    """Never a raw control character; an escape counts as one character or is refused, declared."""
    b = backend(name)
    compiled = b.compile(JsonSchema(BOUNDED))
    keywords, refusals = warned_keywords(compiled.warnings)
    # a backend that declares escapes refused must still take every valid escape-free value
    escapes_refused = refusals and {"minLength", "maxLength"} <= keywords
    for text in BOUNDED_TEXTS:
        valid = _valid(text)
        for got in fresh_accepts(name, compiled, text):
            assert not got or valid, f"{name} accepted {text!r}, which the oracle refuses"
            if got or not valid or (escapes_refused and "\\" in text):
                continue
            # llguidance 1.9 and the outlines adapter spell non-control characters only raw
            # (test_field_faults.test_valid_escapes_in_plain_strings): the value must then be
            # accepted in that spelling, so no value is lost
            canonical = json.dumps(json.loads(text), ensure_ascii=False)
            assert "\\u" in text, f"{name} refused {text!r}"
            assert fresh_accepts(name, compiled, canonical) == {True}, f"{name}: {canonical}"
    if name == "xgrammar":  # raw control characters fixed; escapes refused (strings.py), declared
        assert escapes_refused, compiled.warnings


# -- a greedy lexer refusing valid Lark text -------------------------------------------------

LEXER_CASES = [
    # (Lark grammar, its language as a Python regex, texts)
    ('start: "a" "bc" | "ab" "d"', r"abc|abd", ["abc", "abd", "ab"]),
    ('start: ("a" | "aa") "ab"', r"aab|aaab", ["aab", "aaab"]),
    ('start: A B\nA: "a" | "ab"\nB: "bc"', r"(?:a|ab)bc", ["abc", "abbc"]),
    ('start: "ab" "b" | "a" "bc"', r"abb|abc", ["abb", "abc"]),
    # no conflict: nothing to declare
    ('start: "a" "ab"', r"aab", ["aab", "ab"]),
    ('start: "<" "<=" ', r"<<=", ["<<=", "<="]),
]


@pytest.mark.parametrize("name", LARK_BACKENDS)
@pytest.mark.parametrize("grammar,language,texts", LEXER_CASES)
def test_lexer_prefix_literals_accept_or_declare(name, grammar, language, texts):
    b = backend(name)
    compiled = b.compile(Lark(grammar))
    lexer_warned = any(w.startswith("lexer:refuses at ") for w in compiled.warnings)
    for text in texts:
        in_language = re.fullmatch(language, text) is not None
        for got in fresh_accepts(name, compiled, text):
            assert not got or in_language, f"{name} accepted {text!r} outside {language}"
            assert got or not in_language or lexer_warned, (
                f"{name} refused {text!r} of {grammar!r} without declaring it"
            )
    if lexer_warned:
        with pytest.raises(UnsupportedGrammarError, match="lexer:refuses"):
            b.compile(Lark(grammar, strict=True))
    else:
        b.compile(Lark(grammar, strict=True))
