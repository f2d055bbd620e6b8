"""Differential acceptance against ``jsonschema`` on the bundled corpora, every JSON backend
(:mod:`spec_grammar.testing.differential`; the table: ``python -m
spec_grammar.testing.differential``).

CI runs the quick sample (8 schemas per corpus, a few hypothesis instances and neighbours
each); ``--run-slow`` or ``SPEC_GRAMMAR_LONG=1`` runs every schema. Either way: no undeclared
false accept, no undeclared false refusal, no matcher error. The harness itself is checked
against its own oracles (Python's ``re`` for the pattern translation, ``json`` for the
documents it writes).
"""

from __future__ import annotations

import json
import os
import re
from decimal import Decimal
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_grammar import get_backend
from spec_grammar.json_schema.pattern import UnsupportedPattern, translate
from spec_grammar.testing import differential as d
from spec_grammar.testing.fixtures import fixture_tokenizer

pytestmark = pytest.mark.integration  # a sweep of real schemas over every backend

BACKENDS = ("xgrammar", "llguidance", "outlines")
LONG = bool(os.environ.get("SPEC_GRAMMAR_LONG"))


@cache
def cases(full: bool) -> dict[str, list[d.Case]]:
    plan = d.FULL if full else d.QUICK
    return {c: d.build_cases(c, plan) for c in d.CORPORA}


def run(name: str, full: bool) -> dict[str, d.Tally]:
    tok, width = fixture_tokenizer("smollm2")
    b = get_backend(name, tok, vocab_size=width, compile_timeout_s=60 if full else 20)
    return d.run_backend(b, cases(full), quick=not full)


def assert_clean(name: str, tallies: dict[str, d.Tally]) -> None:
    defects = [f"{c}: {line}" for c, t in tallies.items() for line in t.defects]
    assert not defects, (
        f"{name}: {len(defects)} undeclared disagreements with jsonschema:\n"
        + "\n".join(defects[:30])
    )
    checked = sum(t.counts["ok"] for t in tallies.values())
    assert checked > 100, f"{name}: only {checked} documents judged"


@pytest.mark.parametrize("name", BACKENDS)
def test_differential_quick(name):
    assert_clean(name, run(name, LONG))


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_differential_full(name):
    assert_clean(name, run(name, True))


# -- the harness against its own oracles -------------------------------------------------------


def test_documents_are_labelled_by_the_oracle():
    for corpus in d.CORPORA:
        for case in cases(False)[corpus]:
            v = d.oracle(case.schema)
            for doc in case.docs:
                assert v.is_valid(doc.instance) == doc.valid, (case.key, doc)
                # the written text is the same JSON value (numbers compared as decimals: a
                # float written in positional notation reads back as an int)
                dec = {"parse_float": Decimal, "parse_int": Decimal}
                text = d.to_json(doc.instance, case.schema)
                assert json.loads(text, **dec) == json.loads(json.dumps(doc.instance), **dec)
    docs = [doc for cs in cases(False).values() for c in cs for doc in c.docs]
    origins = {doc.origin.split(":")[0] for doc in docs}
    assert {"suite", "hypothesis", "neighbour"} <= origins
    kinds = {doc.origin for doc in docs if not doc.valid}
    for kind in ("wrong-type", "required", "enum"):
        assert f"neighbour:{kind}" in kinds, kinds


def test_neighbours_cover_the_keywords():
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[a-z]+$"},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
            "a": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
            "c": {"const": "k"},
        },
        "required": ["s", "n"],
        "additionalProperties": False,
    }
    v = d.oracle(schema)
    inst = {"s": "abc", "n": 5, "a": ["x"], "c": "k"}
    failing = set()
    for _kind, x in d.neighbours(inst, schema):
        failing |= d.failing_keywords(v, x)
    for kw in ("type", "required", "additionalProperties", "minLength", "maxLength", "pattern"):
        assert kw in failing
    for kw in ("minimum", "maximum", "minItems", "maxItems", "enum", "const"):
        assert kw in failing


def test_tokenizations_spell_the_text():
    tok, width = fixture_tokenizer("smollm2")
    b = get_backend("llguidance", tok, vocab_size=width)
    t = d.Tokenizations(b.tokenizer_info)
    tb = b.tokenizer_info.token_bytes
    for text in ['{"a": "\\u0001\\n"}', "\u00e9\U0001f600 x", '"\u0663"']:
        for ids in (t.canonical(text), t.chars(text)):
            assert b"".join(tb[i] for i in ids) == text.encode()
        assert len(t.chars(text)) >= len(text)
    assert t.canonical("\U0007c589") is None  # SmolLM2 has no token for byte 0xF1


def test_ecma_dollar():
    v = d.oracle({"pattern": "^a$"})
    assert v.is_valid("a") and not v.is_valid("a\n")
    assert d.ecma_end(r"^[$]\$a$") == r"^[$]\$a\Z"


PATTERNS = st.sampled_from(
    [
        "abc",
        "^a|b$",
        "^ab$|^cd$",
        "(^a|b)c",
        r"^[\]\-a]+$",
        r"^[^a]+$",
        r"^a.c$",
        r"\w+",
        r"^\d{2,3}$",
        r"^[\s\S]$",
        r"(?s)^a.$",
        r"^(?:a|bc)*$",
        "^$",
        r"x\Z",
        r"\Aab",
    ]
)
ALPHABET = st.sampled_from(list('abcdx1 \n\t"\\]-\u00e9\u0663\x01'))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(PATTERNS, st.lists(ALPHABET, max_size=6).map("".join))
def test_translation_matches_search(pattern, value):
    """``translate`` in full == ``re.search`` (``$`` as ECMA): on the value, and on its JSON
    text between the quotes."""
    want = re.search(d.ecma_end(pattern), value) is not None
    r = translate(pattern, "value")
    assert (r is not None and re.fullmatch(r, value) is not None) == want
    rj = translate(pattern, "json")
    # the spelling json.dumps writes; printable characters are not also matched as \uXXXX
    text = json.dumps(value, ensure_ascii=False)
    assert (rj is not None and re.fullmatch(rj, text[1:-1]) is not None) == want, text


def test_translation_refuses_what_it_cannot_write():
    for pattern, feature in [
        (r"(?=a)b", "look"),
        (r"(?<!a)b", "look"),
        (r"(a)\1", "backreference"),
        (r"\bword", "anchor"),
        (r"(?i)abc", "flags"),
        (r"a^b", "anchor"),
    ]:
        with pytest.raises(UnsupportedPattern) as e:
            translate(pattern)
        assert feature in e.value.feature, (pattern, e.value.feature)
