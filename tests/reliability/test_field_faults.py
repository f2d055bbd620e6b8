"""Fault kinds reported from the field, one test per kind and backend, against an oracle.

Each kind is either fixed (the backend agrees with the oracle), or declared: the compile
carries a warning naming the keyword (``<keyword> at ...`` for what is not enforced,
``<keyword>:refuses at ...`` for valid documents refused) and strict mode raises
:class:`UnsupportedGrammarError`. Oracles: ``jsonschema`` for documents
(:func:`spec_grammar.testing.differential.oracle`: Draft 2020-12, ``$`` read as ECMA 262),
Python's ``re.fullmatch`` for ``Regex`` specs, and a fresh matcher replaying what a walk over
the masks produced.
"""

from __future__ import annotations

import json
import random
import re
import time
from functools import cache

import pytest

from spec_grammar import get_backend
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import GrammarCompileError, UnsupportedGrammarError
from spec_grammar.specs import JsonSchema, Regex, ToolCalls
from spec_grammar.testing.differential import (
    Tokenizations,
    accepts,
    oracle,
    warned_keywords,
)
from spec_grammar.testing.fixtures import fixture_tokenizer

JSON_BACKENDS = ("xgrammar", "llguidance", "outlines")
REGEX_BACKENDS = (*JSON_BACKENDS, "interegular")


@cache
def backend(name: str):
    tok, width = fixture_tokenizer("smollm2")
    return get_backend(name, tok, vocab_size=width, compile_timeout_s=60)


@cache
def toks(name: str) -> Tokenizations:
    return Tokenizations(backend(name).tokenizer_info)


def verdicts(name: str, compiled, text: str) -> set[bool]:
    """Whether a fresh matcher accepts ``text`` + EOS, in each tokenization that spells it."""
    b = backend(name)
    eos = b.tokenizer_info.stop_token_ids[0]
    t = toks(name)
    out = set()
    for ids in (t.canonical(text), t.chars(text)):
        if ids is not None:
            out.add(accepts(b.matcher(compiled), ids, eos))
    assert out, f"no tokenization spells {text!r}"
    return out


def check_documents(name: str, schema, texts: list[str], **spec_kw) -> list[str]:
    """Compile ``schema`` on ``name`` and judge each JSON text against the oracle. A
    disagreement must be declared: a false accept by a warning naming a failing keyword, a
    false refusal by a ``:refuses`` warning; a declared compile must then fail in strict mode.
    Returns the warnings."""
    b = backend(name)
    compiled = b.compile(JsonSchema(schema, **spec_kw))
    warned, refusals = warned_keywords(compiled.warnings)
    v = oracle(schema)
    bad = []
    for text in texts:
        instance = json.loads(text)
        errors = list(v.iter_errors(instance))
        valid = not errors
        failing = {str(e.validator) for e in errors} | {
            p for e in errors for p in e.absolute_schema_path if isinstance(p, str)
        }
        for got in verdicts(name, compiled, text):
            if got and not valid and not failing & warned:
                bad.append(f"false accept {text!r} (failing: {sorted(failing)})")
            if not got and valid and not refusals:
                bad.append(f"false refusal {text!r}")
    assert not bad, (
        f"{name} {json.dumps(schema)[:200]}: " + "; ".join(bad) + f" warnings={compiled.warnings}"
    )
    if compiled.warnings:
        with pytest.raises(UnsupportedGrammarError):
            b.compile(JsonSchema(schema, strict=True, **spec_kw))
    return list(compiled.warnings)


# -- regex features inside a schema `pattern` -------------------------------------------------

PATTERN_VALUES = [
    "",
    "a",
    "b",
    "ab",
    "abc",
    "xxabcyy",
    "cd",
    "abcd",
    "ba",
    "a\n",
    "\na",
    'a"c',
    "a\\c",
    "]-a",
    "\u00e9",
    "\u0663",
    "1 2",
    "\x01",
    "a\tb",
    "\U0001f600",
]

PATTERNS = [
    "abc",  # unanchored: a search, matches inside
    "^a|b$",  # top-level alternation: each side anchored on its own
    "^ab$|^cd$",  # anchors inside the alternatives
    "^(ab|cd)$",
    "a$",
    "^a",
    r"^[\]\-a]+$",  # escapes inside a class
    r'^[^a"]+$',  # negated class: must not end the JSON string
    r"^a.c$",  # `.` takes `"` and `\` (written as escapes)
    r"^\w+$",  # Python's Unicode classes (jsonschema's reading)
    r"^\d$",
    r"^[\s\d]+$",
    r"^(?=a)\w+$",  # look-ahead: no regular translation
    r"(?<!a)b",  # look-behind
]


@pytest.mark.parametrize("name", JSON_BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_schema_pattern_features(name, pattern):
    texts = [json.dumps(v, ensure_ascii=False) for v in PATTERN_VALUES]
    warnings = check_documents(name, {"type": "string", "pattern": pattern}, texts)
    if pattern in (r"^(?=a)\w+$", r"(?<!a)b"):
        assert any(w.startswith("pattern at /:") for w in warnings), warnings


@pytest.mark.parametrize("name", REGEX_BACKENDS)
@pytest.mark.parametrize(
    "pattern", [r"(?=a)\w+", r"^a|b$", "a|bc", r"[\]\-a]+", r"[^a]+", r"\w+", "a.c"]
)
def test_regex_spec_features(name, pattern):
    """A ``Regex`` spec matches in full: each backend agrees with ``re.fullmatch`` on every
    probe, or refuses the spec with a typed error (a construct it would ignore)."""
    b = backend(name)
    try:
        compiled = b.compile(Regex(pattern))
    except (UnsupportedGrammarError, GrammarCompileError):
        return
    warned, refusals = warned_keywords(compiled.warnings)
    bad = []
    for s in PATTERN_VALUES + ["bc", "ac", "aa"]:
        want = re.fullmatch(pattern, s) is not None
        for got in verdicts(name, compiled, s):
            if got != want and not (refusals and not got):
                bad.append(f"{s!r}: accepted={got} fullmatch={want}")
    assert not bad, f"{name} Regex({pattern!r}): " + "; ".join(bad)


def test_xgrammar_log_lines_are_read():
    """xgrammar prints ignored regex constructs on stderr and compiles anyway: the adapter
    reads the line and refuses the Regex instead of matching another language."""
    with pytest.raises(UnsupportedGrammarError, match="found in the middle"):
        backend("xgrammar").compile(Regex(r"a^b"))
    import xgrammar as xgr
    from spec_grammar_xgrammar import _library_log

    with _library_log() as lines:
        xgr.Grammar.from_regex(r"^ab$|^cd$")
    assert any("found in the middle" in line for line in lines), lines


# -- recursion at a depth limit ---------------------------------------------------------------

TREE = {
    "type": "object",
    "properties": {"c": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["c"],
    "additionalProperties": False,
}


def _tree(depth: int) -> str:
    doc = {"c": []}
    for _ in range(depth):
        doc = {"c": [doc]}
    return json.dumps(doc)


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_recursion_depth(name):
    texts = [_tree(d) for d in range(9)] + ['{"c": [{"c": [], "x": 1}]}', '{"c": [1]}']
    warnings = check_documents(name, TREE, texts)
    if name == "outlines":
        assert any(w.startswith("$ref:refuses at /properties/c/items") for w in warnings)
    # what the masks let through is valid (or declared: outlines' `$ref` line) and replays on
    # a fresh matcher
    declared = any(w.startswith("$ref at ") for w in warnings)
    for doc in walk_documents(name, TREE, n=6, max_tokens=120):
        assert declared or oracle(TREE).is_valid(json.loads(doc)), doc


def walk_documents(name: str, schema, *, n: int, max_tokens: int, seed: int = 0) -> list[str]:
    """Documents a random walk over the allowed tokens produces (stop token taken as soon as it
    is allowed after a few tokens), each replayed through a fresh matcher."""
    b = backend(name)
    compiled = b.compile(JsonSchema(schema))
    info = b.tokenizer_info
    eos = info.stop_token_ids[0]
    rng = random.Random(seed)
    mask = allocate_token_bitmask(1, b.vocab_size)
    out = []
    for _ in range(n):
        m, ids = b.matcher(compiled), []
        while len(ids) < max_tokens and not m.is_terminated():
            m.fill_next_token_bitmask(mask, 0)
            bits = mask[0].numpy().view("uint32")
            allowed = [
                w * 32 + k
                for w in bits.nonzero()[0].tolist()
                for k in range(32)
                if (int(bits[w]) >> k) & 1
            ]
            assert allowed, "a state with no allowed token"
            t = eos if eos in allowed and len(ids) > 3 else rng.choice(allowed)
            assert m.accept_token(t)
            ids.append(t)
        if not m.is_terminated():
            continue
        replay = b.matcher(compiled)
        assert replay.accept_tokens(ids) == len(ids) and replay.is_terminated()
        out.append(info.decode(ids[:-1]))
    return out


# -- string length and escapes ----------------------------------------------------------------

LENGTH_VALUES = [
    "a",
    "ab",
    "abc",
    "abcd",
    "\n\n",
    "\n\n\n\n",
    '""',
    "\\\\\\",
    "\x01\x02",
    "\u00e9\u00e9",
    "\U0001f600\U0001f600",
    "\U0001f600",
]


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_length_counts_decoded_characters(name):
    texts = [json.dumps(v, ensure_ascii=False) for v in LENGTH_VALUES]
    texts += [json.dumps(v) for v in LENGTH_VALUES if not v.isascii()]  # \uXXXX spellings
    # the \uXXXX spellings are judged on their value; a refusal of that spelling alone is the
    # escape fault below, so only ASCII-spelled values are asserted here
    check_documents(
        name, {"type": "string", "minLength": 2, "maxLength": 3}, texts[: len(LENGTH_VALUES)]
    )


ESCAPED = [
    '"\\u0041"',
    '"\\u00e9"',
    '"\\ud83d\\ude00"',
    '"\\/"',
    '"\\u001f"',
    '"\\b\\f\\n\\r\\t"',
    '"\\"\\\\"',
]


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_valid_escapes_in_plain_strings(name):
    """Every JSON escape of a plain string is accepted, except the known spelling restrictions of
    llguidance 1.9 and the outlines adapter (``\\uXXXX`` only for control characters;
    llguidance: no ``\\/``): there the same value must be accepted in its canonical spelling,
    so no value is lost."""
    b = backend(name)
    compiled = b.compile(JsonSchema({"type": "string"}))
    for text in ESCAPED:
        got = verdicts(name, compiled, text)
        if got == {True}:
            continue
        assert name in ("llguidance", "outlines"), f"{name} refused {text}"
        canonical = json.dumps(json.loads(text), ensure_ascii=False)
        assert verdicts(name, compiled, canonical) == {True}, f"{name}: {canonical} refused too"


# -- enum / const ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_conflicting_enum_const(name):
    b = backend(name)
    with pytest.raises(GrammarCompileError):
        b.compile(JsonSchema({"const": "a", "enum": ["b"]}))
    check_documents(name, {"enum": ["a", "b"], "const": "b"}, ['"a"', '"b"', '"c"'])
    nested = {
        "type": "object",
        "properties": {"x": {"type": "integer", "const": 1, "enum": [1.0, 2]}},
        "required": ["x"],
        "additionalProperties": False,
    }
    check_documents(name, nested, ['{"x": 1}', '{"x": 2}', '{"x": 3}'])


# -- special tokens never inside JSON ----------------------------------------------------------

SPECIAL_SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string"}, "t": {"type": "string", "pattern": "^.*$"}},
    "required": ["s", "t"],
    "additionalProperties": False,
}


def _specials_allowed(name: str, compiled, prefix: str, stops: bool = True) -> list[int]:
    """Special ids (with ``stops``: stop tokens too) that the row after ``prefix`` allows or a
    matcher there accepts."""
    b = backend(name)
    info = b.tokenizer_info
    m = b.matcher(compiled)
    ids = toks(name).canonical(prefix)
    assert m.accept_tokens(ids) == len(ids), prefix
    mask = allocate_token_bitmask(1, b.vocab_size)
    m.fill_next_token_bitmask(mask, 0)
    row = mask[0]
    specials = sorted(set(info.special_token_ids) | set(info.stop_token_ids if stops else ()))
    specials = [t for t in specials if stops or t not in info.stop_token_ids]
    bad = {t for t in specials if (int(row[t >> 5]) >> (t & 31)) & 1}
    for t in specials:  # accept agrees with the row
        fresh = b.matcher(compiled)
        fresh.accept_tokens(ids)
        if fresh.accept_token(t):
            bad.add(t)
    return sorted(bad)


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_special_tokens_never_inside_json_strings(name):
    b = backend(name)
    compiled = b.compile(JsonSchema(SPECIAL_SCHEMA))
    for prefix in ['{"s": "', '{"s": "ab', '{"s": "a", "t": "', '{"s": "a", "t": "x']:
        assert _specials_allowed(name, compiled, prefix) == [], prefix
    tools = ToolCalls(
        [{"type": "function", "function": {"name": "f", "parameters": SPECIAL_SCHEMA}}]
    )
    compiled = b.compile(tools)
    assert _specials_allowed(name, compiled, '[{"name": "f", "arguments": {"s": "') == []


@pytest.mark.parametrize("name", REGEX_BACKENDS)
def test_special_tokens_never_in_regex_text(name):
    b = backend(name)
    compiled = b.compile(Regex("[^x]*"))
    assert _specials_allowed(name, compiled, "ab", stops=False) == []


# -- schemas with no finite document ----------------------------------------------------------

NO_FINITE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "array", "prefixItems": [{"$ref": "#/$defs/a"}], "minItems": 1},
        },
        "$ref": "#/$defs/a",
    },
]


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_no_finite_document_is_a_compile_error(name):
    b = backend(name)
    for schema in NO_FINITE:
        t0 = time.perf_counter()
        with pytest.raises(GrammarCompileError, match="no finite document"):
            b.compile(JsonSchema(schema))
        assert time.perf_counter() - t0 < 5
    # satisfiable recursion is not refused (outlines-core may refuse it with a typed error:
    # "Ref recursion limit reached")
    ok = {
        "anyOf": [
            {"type": "null"},
            {"type": "array", "items": {"$ref": "#"}, "minItems": 1, "maxItems": 2},
        ]
    }
    try:
        check_documents(name, ok, ["null", "[null]", "[[null]]", "[]", "[[]]"])
    except GrammarCompileError as e:
        assert name == "outlines" and "recusion limit" in str(e).lower(), e
