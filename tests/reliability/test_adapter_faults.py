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
import time
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


# -- a large enum of strings: xgrammar's first fills stall ----------------------------------


def _string_enum(n: int, length: int) -> dict:
    return {"enum": [f"value_{i:06d}_".ljust(length, "x") for i in range(n)]}


def _fill_after_quote(b, compiled) -> float:
    """Seconds of the first mask fill after the opening quote (where xgrammar stalled)."""
    from spec_grammar.bitmask import allocate_token_bitmask

    m = b.matcher(compiled)
    quote = Tokenizations(b.tokenizer_info).canonical('"')
    assert m.accept_tokens(quote) == len(quote)
    t0 = time.perf_counter()
    m.fill_next_token_bitmask(allocate_token_bitmask(1, b.vocab_size))
    return time.perf_counter() - t0


def test_xgrammar_refuses_a_string_enum_past_its_bound_and_takes_one_under_it():
    """10,000 strings (180 KB: the first fill after the quote took over 100 s) are refused
    with GrammarLimitError naming max_enum_bytes, before the library sees them; 700 strings of
    100 characters (71.4 KB, under the bound) compile and fill in milliseconds."""
    pytest.importorskip("xgrammar")
    from spec_grammar_xgrammar import DEFAULT_MAX_ENUM_BYTES, largest_string_enum

    b = backend("xgrammar")
    big = {"type": "object", "properties": {"k": _string_enum(10_000, 16)}}
    assert largest_string_enum(big) == (180_000, "/properties/k/enum")
    t0 = time.perf_counter()
    with pytest.raises(GrammarLimitError, match="enum at /properties/k/enum .* max_enum_bytes"):
        b.compile(JsonSchema(big))
    assert time.perf_counter() - t0 < 2.0
    under = _string_enum(700, 100)
    assert largest_string_enum(under)[0] < DEFAULT_MAX_ENUM_BYTES
    assert _fill_after_quote(b, b.compile(JsonSchema(under))) < 2.0


def test_auto_routes_a_large_string_enum_to_llguidance():
    """``auto`` ranks xgrammar first for an enum; past xgrammar's bound it compiles on
    llguidance (10,000 strings: its fill after the quote takes milliseconds), which accepts
    a member and refuses a near miss (oracle: ``jsonschema``)."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("llguidance")
    schema = _string_enum(10_000, 16)
    compiled = backend("auto").compile(JsonSchema(schema))
    assert compiled.route.startswith("llguidance:") and "max_enum_bytes" in compiled.route
    assert _fill_after_quote(backend("auto"), compiled) < 2.0
    member, miss = json.dumps(schema["enum"][4321]), json.dumps(schema["enum"][4321][:-1])
    assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(member))
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(miss))
    b = backend("auto")
    t = Tokenizations(b.tokenizer_info)
    eos = b.tokenizer_info.stop_token_ids[0]
    assert accepts(b.matcher(compiled), t.canonical(member), eos)
    assert not accepts(b.matcher(compiled), t.canonical(miss), eos)


# -- numbers xgrammar cannot read -------------------------------------------------------------


@pytest.mark.parametrize(
    "schema,keyword",
    [
        ({"type": "integer", "minimum": 10**400}, "minimum at /"),
        ({"type": "number", "maximum": -(10**400)}, "maximum at /"),
        ({"properties": {"n": {"type": "integer", "exclusiveMaximum": 2**63}}}, "/properties/n"),
    ],
)
def test_xgrammar_out_of_range_numbers_are_typed(schema, keyword):
    """A bound past a double (xgrammar raised RuntimeError with an empty message) or an
    integer bound past 64 bits (a failed native check): GrammarLimitError naming it."""
    pytest.importorskip("xgrammar")
    with pytest.raises(GrammarLimitError, match=f"the .*{re.escape(keyword)}.* xgrammar 0.2.9"):
        backend("xgrammar").compile(JsonSchema(schema))


@pytest.mark.parametrize("bound", [10**40, 2**63, -(2**63)])
def test_llguidance_integer_bounds_past_64_bits_are_refused(bound):
    """llguidance 1.9 clamps an integer bound to 64 bits (``minimum: 10**40`` wrote
    ``9223372036854775807``, invalid, while strict claimed it enforced): GrammarLimitError."""
    pytest.importorskip("llguidance")
    schema = {"type": "integer", "minimum": bound, "maximum": bound + 5}
    with pytest.raises(GrammarLimitError, match="the minimum at / .* llguidance 1.9"):
        backend("llguidance").compile(JsonSchema(schema, strict=True))
    inside = {"type": "integer", "minimum": 10**15, "maximum": 10**15 + 5}
    ok = backend("llguidance").compile(JsonSchema(inside))
    assert fresh_accepts("llguidance", ok, str(10**15 + 5)) == {True}


def test_xgrammar_bounds_within_range_still_compile():
    """Just inside the ranges: an integer bound of 2**62 and a number bound of 1e308 compile,
    and the bound holds (oracle: ``jsonschema``)."""
    pytest.importorskip("xgrammar")
    schema = {"type": "integer", "minimum": 2**62}
    compiled = backend("xgrammar").compile(JsonSchema(schema))
    assert fresh_accepts("xgrammar", compiled, str(2**62)) == {True}
    assert not jsonschema.Draft202012Validator(schema).is_valid(2**62 - 1)
    assert fresh_accepts("xgrammar", compiled, str(2**62 - 1)) == {False}
    backend("xgrammar").compile(JsonSchema({"type": "number", "maximum": 1e308}))
