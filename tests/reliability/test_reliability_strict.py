"""Strict mode (``JsonSchema(..., strict=True)``) and the ignored-keyword warnings, on every
backend, with the declarations of :attr:`GrammarBackend.json_schema_support` kept honest.

Honesty oracle: the JSON-Schema-Test-Suite (draft 2020-12) and ``jsonschema``. Every group a
backend compiles in strict mode must reject every instance ``jsonschema`` rejects (each
instance ``json.dumps``-ed, tokenized with SmolLM2 and fed with EOS). The suite's schemas
mostly omit ``type``; each group whose top-level keywords all constrain one JSON type is also
run with that ``type`` added (``jsonschema`` re-judges every instance), so a keyword a backend
ignores only without ``type`` cannot hide behind the other declaration.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from functools import cache

import jsonschema
import pytest

from spec_grammar import get_backend
from spec_grammar.datasets import json_schema_test_suite
from spec_grammar.errors import GrammarCompileError, UnsupportedGrammarError
from spec_grammar.json_schema.strict import (
    LENGTH_WITH_PATTERN,
    REMOTE_REF,
    REQUIRED_UNDECLARED,
    TYPE_KEYWORDS,
    KeywordSupport,
    unenforced_keywords,
)
from spec_grammar.specs import JsonSchema
from spec_grammar.testing.fixtures import fixture_tokenizer as _fixture_tokenizer

BACKENDS = ("xgrammar", "llguidance", "outlines")
LONG = bool(os.environ.get("SPEC_GRAMMAR_LONG"))

# The quick run (CI) takes these files; the long run (SPEC_GRAMMAR_LONG=1 or --run-slow with the
# slow test) takes the whole suite. outlines-core builds an index over the vocabulary per schema
# (0.3-1 s each), so its quick run is shorter still.
QUICK_FILES = frozenset(
    {
        "type.json",
        "enum.json",
        "const.json",
        "required.json",
        "properties.json",
        "minLength.json",
        "maxLength.json",
        "minimum.json",
        "maximum.json",
        "minItems.json",
        "maxItems.json",
        "pattern.json",
        "anyOf.json",
        "prefixItems.json",
        "exclusiveMinimum.json",
        "uniqueItems.json",
        "multipleOf.json",
        "additionalProperties.json",
        "patternProperties.json",
        "oneOf.json",
        "allOf.json",
        "items.json",
    }
)
OUTLINES_QUICK_FILES = frozenset(
    {
        "type.json",
        "enum.json",
        "required.json",
        "minLength.json",
        "maxItems.json",
        "minimum.json",
        "pattern.json",
    }
)

KNOWN_UNSOUND: dict[str, dict[str, str]] = {}
"""backend -> {test-suite key -> why an instance jsonschema rejects is accepted although the
strict compile passed}. Each entry is a library fault found by this test, reported upstream."""


_CONSTRAINING = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")


def has_unconstrained(schema: object, root: bool = True) -> bool:
    """True when ``schema`` or a subschema accepts any JSON value (``{}``, ``true``, no
    type-fixing keyword, an array without ``items``, an open object): outlines-core's regex for "any JSON" (13.9 KB)
    makes an Index that
    does not finish within a minute, so those groups are left out for outlines."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return False
    if not any(k in schema for k in _CONSTRAINING):
        return True
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if "array" in types and schema.get("items") is None:
        return True
    if "object" in types and schema.get("additionalProperties", True) is not False:
        return True
    subs = [schema.get(k) for k in ("items", "additionalProperties", "contains", "not")]
    subs += [x for k in ("anyOf", "oneOf", "allOf", "prefixItems") for x in schema.get(k, []) or []]
    subs += list((schema.get("properties") or {}).values())
    return any(has_unconstrained(x, False) for x in subs if x is not None and x is not False)


@cache
def fixture_tokenizer(name: str):
    return _fixture_tokenizer(name)  # load_tokenizer re-reads the files on every call


@cache
def backend(name: str):
    tok, width = fixture_tokenizer("smollm2")
    return get_backend(name, tok, vocab_size=width)


def _single_type(schema: dict) -> str | None:
    types = {TYPE_KEYWORDS[k] for k in schema if k in TYPE_KEYWORDS}
    return types.pop() if len(types) == 1 and "type" not in schema else None


def suite_groups(
    files: frozenset[str] | None = None,
) -> list[tuple[str, object, list[tuple[object, bool]]]]:
    """``(key, schema, [(instance, jsonschema_valid)])`` per suite group and typed variant."""
    out = []
    for g in json_schema_test_suite():
        if files is not None and g["file"] not in files:
            continue
        key = f"{g['file']}#{g['group_index']}"
        variants = [(key, g["schema"])]
        t = _single_type(g["schema"]) if isinstance(g["schema"], dict) else None
        if t is not None:
            variants.append((f"{key}+type:{t}", {**g["schema"], "type": t}))
        for k, schema in variants:
            try:
                check = jsonschema.Draft202012Validator(schema)
                cases = [(t["data"], check.is_valid(t["data"])) for t in g["tests"]]
            except Exception:  # Python's `re` lacks \p{..}: keep the suite's own labels
                if k != key:
                    continue
                cases = [(t["data"], bool(t["valid"])) for t in g["tests"]]
            out.append((k, schema, cases))
    return out


def accepts(b, compiled, instance) -> bool:
    tok = b.tokenizer_info.hf_tokenizer
    ids = tok.encode(json.dumps(instance), add_special_tokens=False) + [
        b.tokenizer_info.stop_token_ids[0]
    ]
    m = b.matcher(compiled)
    return m.accept_tokens(ids) == len(ids) and m.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_strict_compiles_are_sound(name):
    """Strict compile passed => no instance jsonschema rejects is accepted (quick file set)."""
    check_strict_sound(
        name, None if LONG else OUTLINES_QUICK_FILES if name == "outlines" else QUICK_FILES
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_strict_compiles_are_sound_whole_suite(name):
    check_strict_sound(name, None)


def check_strict_sound(name: str, files: frozenset[str] | None) -> None:
    b = backend(name)
    unsound, passed, refused = [], defaultdict(int), defaultdict(int)
    for key, schema, cases in suite_groups(files):
        if name == "outlines" and has_unconstrained(schema):
            continue
        try:
            compiled = b.compile(JsonSchema(schema, strict=True))
        except UnsupportedGrammarError:
            refused[key.split("#")[0]] += 1
            continue
        except GrammarCompileError:
            continue  # the library refuses the schema: nothing can be accepted
        passed[key.split("#")[0]] += 1
        for i, (instance, valid) in enumerate(cases):
            k = f"{key}/{i}"
            if (
                not valid
                and accepts(b, compiled, instance)
                and k not in KNOWN_UNSOUND.get(name, {})
            ):
                unsound.append(
                    f"{k}: schema {json.dumps(schema)[:160]} accepted {json.dumps(instance)[:80]}"
                )
    assert not unsound, f"{name}: strict mode passed schemas it does not enforce:\n" + "\n".join(
        unsound
    )
    # strict mode must stay usable: typed, core-keyword schemas compile (length-bounded strings
    # too, but on xgrammar, whose bounded strings refuse escapes, declared: adapter strings.py)
    files = ("type.json", "enum.json") + (() if name == "xgrammar" else ("minLength.json",))
    for f in files:
        assert passed[f] > 0, f"{name}: strict mode refused every group of {f}"


@pytest.mark.parametrize("name", BACKENDS)
def test_strict_refuses_and_lenient_warns(name):
    b = backend(name)
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"],
        # closed: outlines-core declares that it refuses undeclared properties of open objects
        "additionalProperties": False,
    }
    with pytest.raises(UnsupportedGrammarError) as err:
        b.compile(JsonSchema(schema, strict=True))
    msg = str(err.value)
    assert msg.startswith(
        f"[{name}] strict mode: 1 keyword use(s) would not be enforced: uniqueItems at /properties/tags"
    )
    compiled = b.compile(JsonSchema(schema))
    assert len(compiled.warnings) == 1 and compiled.warnings[0].startswith(
        "uniqueItems at /properties/tags: "
    )
    # a schema every backend enforces in full compiles in strict mode with no warning
    # (no length bound: xgrammar declares that it refuses escapes in length-bounded strings)
    clean = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "role": {"enum": ["admin", "user"]},
        },
        "required": ["name", "role"],
        "additionalProperties": False,
    }
    strict = b.compile(JsonSchema(clean, strict=True))
    assert strict.warnings == () and b.compile(JsonSchema(clean)).warnings == ()
    assert accepts(b, strict, {"name": "Ann", "role": "user"}) and not accepts(
        b, strict, {"name": "Ann", "role": "x"}
    )


def test_declarations_name_known_keywords():
    known = set(TYPE_KEYWORDS) | {
        "type",
        "enum",
        "const",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        REMOTE_REF,
        REQUIRED_UNDECLARED,
        LENGTH_WITH_PATTERN,
    }
    for name in BACKENDS:
        support = type(backend(name)).json_schema_support
        assert isinstance(support, KeywordSupport)
        assert set(support.unenforced) <= known, (
            f"{name}: unknown keywords {set(support.unenforced) - known}"
        )
        assert all(reason.strip() for reason in support.unenforced.values())


def test_walker_paths_and_pseudo_keywords():
    support = KeywordSupport(
        unenforced={"uniqueItems": "u", REMOTE_REF: "r", REQUIRED_UNDECLARED: "q"}, untyped="t"
    )
    schema = {
        "type": "object",
        "properties": {
            "a/b": {"type": "array", "uniqueItems": True},
            "uniqueItems": {"minLength": 2},
        },
        "required": ["a/b", "zz"],
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "other.json"}},
        "anyOf": [{"maxItems": 3, "type": "array"}, True],
    }
    assert unenforced_keywords(schema, support) == [
        "uniqueItems at /properties/a~1b: u",
        "minLength at /properties/uniqueItems (no `type` next to it): t",
        "required:undeclared at /: q",
        "$ref:uri at /$defs/y: r",
    ]
    assert unenforced_keywords(True, support) == [] and unenforced_keywords({}, support) == []


LENGTH_NEXT_TO_PATTERN = [
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, ["ab", "abc", "abcd", "AB"]),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, ["a", "ab", "abc"]),
    ({"type": "string", "format": "email", "maxLength": 6}, ["a@b.co", "ab@cd.ef"]),
    ({"type": ["string", "null"], "pattern": "^[a-z]+$", "minLength": 3}, ["ab", "abc", None]),
    (
        {
            "type": "object",
            "properties": {"s": {"type": "string", "pattern": "^x+$", "maxLength": 2}},
            "required": ["s"],
            "additionalProperties": False,
        },
        [{"s": "xxx"}, {"s": "x"}],
    ),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("schema, instances", LENGTH_NEXT_TO_PATTERN)
def test_length_next_to_a_pattern_or_format_is_enforced_or_refused(name, schema, instances):
    """xgrammar drops minLength / maxLength next to a pattern or a format (its log says so on
    stderr), yet strict mode compiled such schemas: "ab" passed ``minLength: 3``. Oracle:
    ``jsonschema`` (formats unchecked); a strict compile refuses the schema or accepts no
    instance that ``jsonschema`` rejects."""
    b = backend(name)
    try:
        compiled = b.compile(JsonSchema(schema, strict=True))
    except UnsupportedGrammarError as e:
        # refused for the length bound (or for the format asserted beside it), and the lenient
        # compile declares the same keyword uses
        declared = ("length:with-pattern", "minLength", "maxLength", "format:refuses")
        assert any(k in str(e) for k in declared), str(e)
        lenient = b.compile(JsonSchema(schema))
        assert any(w.startswith(declared) for w in lenient.warnings), lenient.warnings
        return
    rejected = [i for i in instances if not jsonschema.Draft202012Validator(schema).is_valid(i)]
    assert rejected
    for instance in rejected:
        assert not accepts(b, compiled, instance), (schema, instance)


def test_the_length_pseudo_keyword_is_reported_where_it_applies():
    support = KeywordSupport(unenforced={LENGTH_WITH_PATTERN: "l"})
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": "x", "minLength": 1, "maxLength": 3},
            "b": {"type": "string", "minLength": 1},
            "c": {"type": "string", "format": "date", "maxLength": 3},
        },
    }
    assert unenforced_keywords(schema, support) == [
        "length:with-pattern at /properties/a: l",
        "length:with-pattern at /properties/c: l",
    ]


@pytest.mark.parametrize("name", BACKENDS)
def test_keywords_that_constrain_nothing_are_not_declared(name):
    """``uniqueItems: false`` and a keyword inside a definition no ``$ref`` reaches constrain
    nothing: no warning, no strict refusal; the same keyword reached by a ``$ref`` is still
    declared where the backend does not enforce it."""
    b = backend(name)
    unused = {
        "$defs": {"u": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "type": "array",
        "items": {"type": "integer"},
        "uniqueItems": False,
    }
    compiled = b.compile(JsonSchema(unused))
    assert not any(w.startswith("uniqueItems") for w in compiled.warnings), compiled.warnings
    if name != "llguidance":  # llguidance 1.9 itself refuses the key when not lenient
        b.compile(JsonSchema(unused, strict=True))
    used = {"$defs": unused["$defs"], "$ref": "#/$defs/u"}
    if "uniqueItems" in type(b).json_schema_support.unenforced:
        with pytest.raises(UnsupportedGrammarError, match="uniqueItems"):
            b.compile(JsonSchema(used, strict=True))
