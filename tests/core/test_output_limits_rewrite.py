"""The output limits' schema rewrites (:mod:`spec_grammar.json_schema.limits`) against
``jsonschema``: on the bundled real schemas the capped schema is a subset of the user's
(every instance it accepts, the user's accepts), keeps every bound the user set, and accepts
the user's documents that are within the limits (JSON-Schema-Test-Suite instances and
hypothesis-drawn documents, checked by ``jsonschema``); the number bounds keep a user's bound
satisfiable. No backend, no model."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_grammar import datasets
from spec_grammar.json_schema.check import has_finite_document
from spec_grammar.json_schema.limits import (
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
    bound_numbers,
    cap_lengths,
    close_objects,
)
from spec_grammar.json_schema.rewrite import map_subschemas
from spec_grammar.specs import JsonSchema, Regex, ToolCalls, with_limits

LIMITS = OutputLimits(max_string_length=8, max_items=3)


def _corpus() -> list[tuple[str, dict]]:
    out = [(f"jsb/{r['id']}", r["schema"]) for r in datasets.jsonschemabench_sample()]
    for c in datasets.bfcl_cases():
        out.append((f"bfcl/{c['id']}", ToolCalls(c["tools"]).to_json_schema().json_schema))
    return [(n, s) for n, s in out if isinstance(s, dict)]


CORPUS = _corpus()


def _nodes(schema) -> dict[str, dict]:
    found: dict[str, dict] = {}

    def node(n, where):
        found[where] = n
        return n

    map_subschemas(schema, node)
    return found


def test_caps_only_add_keywords_and_keep_user_bounds():
    """Each subschema of the capped schema is the user's with at most maxLength / maxItems
    added, each added bound >= the user's own minimum, and none where the user set one."""
    changed = 0
    for name, schema in CORPUS:
        before, after = _nodes(schema), _nodes(cap_lengths(schema, LIMITS))
        assert set(before) == set(after), name
        for at, old in before.items():
            new = after[at]
            added = {k: v for k, v in new.items() if k not in old}
            # keywords whose values are not subschemas are kept as written
            flat = {k: v for k, v in old.items() if not isinstance(v, (dict, list))}
            assert {k: new[k] for k in flat} == flat, (name, at)
            assert set(added) <= {"maxLength", "maxItems"}, (name, at, added)
            if "maxLength" in added:
                assert added["maxLength"] == max(8, old.get("minLength", 0)), (name, at)
            if "maxItems" in added:
                assert added["maxItems"] >= max(3, old.get("minItems", 0)), (name, at)
            changed += bool(added)
    assert changed > 50  # the corpus has open strings and arrays to cap


def _within(doc, limits: OutputLimits) -> bool:
    if isinstance(doc, str):
        return len(doc) <= limits.max_string_length
    if isinstance(doc, list):
        return len(doc) <= limits.max_items and all(_within(x, limits) for x in doc)
    if isinstance(doc, dict):
        return all(_within(v, limits) for v in doc.values())
    return True


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _implications(user, limited, doc) -> None:
    """The two properties: the capped schema accepts only what the user's accepts, and keeps
    every user document within the limits."""
    if limited.is_valid(doc):
        assert user.is_valid(doc)
    if _within(doc, LIMITS) and user.is_valid(doc):
        assert limited.is_valid(doc)


def test_capped_suite_schemas_against_the_suites_instances():
    """JSON-Schema-Test-Suite instances (valid and invalid ones) under each group's schema and
    its capped form; and its closed form (:func:`close_objects`), which must accept no
    instance the user's schema refuses (the suite's ``oneOf`` / ``allOf`` / ``not`` groups are
    where closing an object could add one)."""
    checked = closed_checked = 0
    for g in datasets.json_schema_test_suite():
        user = jsonschema.Draft202012Validator(g["schema"])
        capped = cap_lengths(g["schema"], LIMITS)
        if capped is not g["schema"]:
            limited = jsonschema.Draft202012Validator(capped)
            for t in g["tests"]:
                _implications(user, limited, t["data"])
                checked += 1
        closed = close_objects(g["schema"])
        if closed is not g["schema"]:
            shut = jsonschema.Draft202012Validator(closed)
            for t in g["tests"]:
                if shut.is_valid(t["data"]):
                    assert user.is_valid(t["data"]), (g["file"], g["group_description"])
                closed_checked += 1
    assert checked > 30 and closed_checked > 30


def test_closed_objects_keep_documents_and_skip_conjunctions():
    for name, schema in CORPUS:
        closed = close_objects(schema)
        assert has_finite_document(closed) == has_finite_document(schema), name
    open_ = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
    }
    assert close_objects(open_)["additionalProperties"] is False
    # a branch of allOf / oneOf, required names not declared: left open
    for schema in (
        {"allOf": [open_, {"properties": {"b": {}}, "required": ["b"]}]},
        {"oneOf": [open_, {"properties": {"b": {}}}]},
        {**open_, "required": ["a", "z"]},
        {**open_, "additionalProperties": {"type": "string"}},
    ):
        assert close_objects(schema) == schema
    # tool-call arguments (inside anyOf, a union) are closed
    tools = ToolCalls(
        [{"type": "function", "function": {"name": "f", "parameters": open_}}]
        + [{"type": "function", "function": {"name": "g", "parameters": open_}}]
    )
    closed = close_objects(tools.to_json_schema().json_schema)
    assert all(
        v["properties"]["arguments"]["additionalProperties"] is False
        for v in closed["items"]["anyOf"]
    )


_VALIDATORS = [
    (
        jsonschema.validators.validator_for(s)(s),
        jsonschema.validators.validator_for(s)(cap_lengths(s, LIMITS)),
        jsonschema.validators.validator_for(s)(close_objects(s)),
    )
    for name, s in CORPUS
]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=_JSON, which=st.integers(0, len(_VALIDATORS) - 1), data=st.data())
def test_capped_corpus_schemas_on_random_documents(doc, which, data):
    """Random JSON documents, and documents assembled from the schema's own property names,
    under a real schema and its capped form."""
    user, limited, shut = _VALIDATORS[which]
    _implications(user, limited, doc)
    if shut.is_valid(doc):
        assert user.is_valid(doc)
    props = user.schema.get("properties") if isinstance(user.schema, dict) else None
    if isinstance(props, dict) and props:
        keys = list(props)
        obj = data.draw(st.dictionaries(st.sampled_from(keys), _JSON, max_size=len(keys)))
        _implications(user, limited, obj)
        if shut.is_valid(obj):
            assert user.is_valid(obj)


@given(
    digits=st.integers(1, 6),
    lo=st.one_of(st.none(), st.integers(-(10**8), 10**8)),
    hi=st.one_of(st.none(), st.integers(-(10**8), 10**8)),
    kind=st.sampled_from(["integer", "number"]),
    value=st.one_of(st.integers(-(10**8), 10**8), st.floats(-1e8, 1e8, allow_nan=False)),
)
def test_number_bounds_subset_and_satisfiable(digits, lo, hi, kind, value):
    """The added bounds only remove instances, never a side the user bounds, and keep a
    satisfiable schema satisfiable (the user's own bound is one of its instances)."""
    schema = {"type": kind}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    out = bound_numbers(
        schema, digits
    )  # fraction=True: multipleOf, which jsonschema checks in floats
    assert {k: out[k] for k in schema} == schema
    if jsonschema.Draft202012Validator(out).is_valid(value):
        assert jsonschema.Draft202012Validator(schema).is_valid(value)
    for bound in (lo, hi):
        if bound is not None and (lo is None or hi is None or lo <= hi):
            assert jsonschema.Draft202012Validator(out).is_valid(bound)
    if abs(value) < 10**digits - 1 and float(value).is_integer():
        if jsonschema.Draft202012Validator(schema).is_valid(value):
            assert jsonschema.Draft202012Validator(out).is_valid(int(value))


def test_limits_validation_and_with_limits():
    with pytest.raises(ValueError, match="max_digits"):
        OutputLimits(max_digits=0)
    with pytest.raises(ValueError, match="max_whitespace"):
        JsonSchema({"type": "string"}, limits={"max_whitespace": 0})
    assert JsonSchema({}, limits={"max_items": 2}).limits == OutputLimits(max_items=2)
    # with_limits: only JSON schemas / tool lists without their own limits
    s = with_limits(JsonSchema({"type": "string"}), DEFAULT_OUTPUT_LIMITS)
    assert s.limits == DEFAULT_OUTPUT_LIMITS
    own = JsonSchema({"type": "string"}, limits=OutputLimits())
    assert with_limits(own, DEFAULT_OUTPUT_LIMITS).limits.is_empty()
    assert with_limits(Regex("a+"), DEFAULT_OUTPUT_LIMITS) == Regex("a+")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert with_limits(ToolCalls(tools), DEFAULT_OUTPUT_LIMITS).to_json_schema().limits == (
        DEFAULT_OUTPUT_LIMITS
    )
    # the limits are part of the compile-cache key
    assert s.cache_key() != JsonSchema({"type": "string"}).cache_key()


ALIASED = [
    # names from a $ref beside the object's own properties
    (
        {
            "type": "object",
            "$ref": "#/$defs/A",
            "properties": {"b": {"type": "integer"}},
            "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        },
        {"a": 1, "b": 2},
        True,
    ),
    # names of the same object from a parent's anyOf branch
    (
        {
            "type": "object",
            "properties": {"p": {"type": "object", "properties": {"a": {}}}},
            "anyOf": [{"properties": {"p": {"properties": {"b": {}}}}}],
        },
        {"p": {"a": 1, "b": 2}},
        True,
    ),
    # a property reached by reference from a oneOf branch: closing it would let more through
    (
        {
            "type": "object",
            "properties": {
                "foo": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "bar": {
                    "oneOf": [
                        {"$ref": "#/properties/foo"},
                        {"type": "object", "required": ["b"]},
                    ]
                },
            },
        },
        {"bar": {"a": 1, "b": 2}},
        False,
    ),
]


@pytest.mark.parametrize("schema,doc,valid", ALIASED)
def test_closing_keeps_names_declared_elsewhere_and_stays_a_subset(schema, doc, valid):
    """Objects whose names may come from another node (a sibling $ref, an applicator branch)
    stay open; the rewrite never accepts what the user's schema rejects (jsonschema)."""
    assert jsonschema.Draft202012Validator(schema).is_valid(doc) == valid
    assert jsonschema.Draft202012Validator(close_objects(schema)).is_valid(doc) == valid
