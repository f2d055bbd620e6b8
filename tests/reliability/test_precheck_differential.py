"""Our own schema analyses tested like the backends: a schema ``jsonschema`` accepts a document
of must pass our pre-checks (the meta-schema check, the finite-document check, after the output
limits' rewrite too). Generated schemas come with a witness document built alongside (the
oracle validates it first, so a wrong witness fails the test, not our check); their definitions
refer to earlier ones and to themselves through optional properties, as real schemas do.

The fault this caught: an object whose required properties ``$ref`` two different definitions
was refused as "accepts no finite document" (the fixpoint stopped before the second reference
was ever met)."""

from __future__ import annotations

import time

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_grammar.datasets import json_schema_test_suite, jsonschemabench_sample
from spec_grammar.json_pointer import resolve_pointer
from spec_grammar.json_schema.check import check_json_schema, has_finite_document
from spec_grammar.json_schema.limits import DEFAULT_OUTPUT_LIMITS, cap_lengths, close_objects

LEAVES = [
    ({"type": "string"}, "x"),
    ({"type": "integer", "minimum": 0}, 0),
    ({"enum": [1, "a"]}, "a"),
    ({"const": None}, None),
    ({"type": "boolean"}, True),
]


def _schema(defs: list[tuple[dict, object]], depth: int):
    """A strategy of (schema, witness): leaves, refs to ``defs`` (index < len), objects with
    required and optional properties, arrays with minItems, anyOf with a dead branch."""
    leaf = st.sampled_from(LEAVES)
    refs = (
        st.integers(0, len(defs) - 1).map(lambda i: ({"$ref": f"#/$defs/d{i}"}, defs[i][1]))
        if defs
        else leaf
    )
    if depth == 0:
        return st.one_of(leaf, refs)
    sub = _schema(defs, depth - 1)

    @st.composite
    def obj(draw):
        props = draw(st.dictionaries(st.sampled_from("abcdef"), sub, min_size=1, max_size=4))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
        schema = {"type": "object", "properties": {k: s for k, (s, _) in props.items()}}
        if required:
            schema["required"] = required
        return schema, {k: props[k][1] for k in required}

    @st.composite
    def arr(draw):
        s, w = draw(sub)
        n = draw(st.integers(0, 3))
        return {"type": "array", "items": s, "minItems": n}, [w] * n

    @st.composite
    def any_of(draw):
        s, w = draw(sub)
        dead = draw(st.sampled_from([False, {"enum": []}, {"not": {}}]))
        branches = [dead, s] if draw(st.booleans()) else [s, dead]
        return {"anyOf": branches}, w

    return st.one_of(leaf, refs, obj(), arr(), any_of())


@st.composite
def schema_with_witness(draw):
    defs: list[tuple[dict, object]] = []
    for i in range(draw(st.integers(0, 4))):
        s, w = draw(_schema(defs, 2))
        if draw(st.booleans()) and isinstance(s, dict) and s.get("type") == "object":
            # a recursive definition: itself behind an optional property
            s = {**s, "properties": {**s["properties"], "next": {"$ref": f"#/$defs/d{i}"}}}
            if "next" in s.get("required", []):
                s["required"] = [r for r in s["required"] if r != "next"]
                w = {k: v for k, v in w.items() if k != "next"}
        defs.append((s, w))
    root, witness = draw(_schema(defs, 3))
    schema = dict(root) if isinstance(root, dict) else {"allOf": [root]}
    if defs:
        schema["$defs"] = {f"d{i}": s for i, (s, _) in enumerate(defs)}
    return schema, witness


def test_two_required_refs_to_different_definitions_have_a_finite_document():
    """The schema of the report (a real one vLLM's xgrammar backend serves has this shape)."""
    schema = {
        "$defs": {"A": {"type": "string"}, "B": {"type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#/$defs/B"}},
        "required": ["a", "b"],
    }
    jsonschema.validate({"a": "x", "b": 1}, schema)
    assert has_finite_document(schema)


def test_unproductive_schemas_are_still_refused():
    assert not has_finite_document(
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    )
    assert not has_finite_document(
        {
            "$defs": {
                "A": {
                    "type": "object",
                    "properties": {"b": {"$ref": "#/$defs/B"}},
                    "required": ["b"],
                },
                "B": {"type": "array", "items": {"$ref": "#/$defs/A"}, "minItems": 1},
            },
            "type": "object",
            "properties": {"x": {"type": "string"}, "a": {"$ref": "#/$defs/A"}},
            "required": ["x", "a"],
        }
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema_with_witness())
def test_a_schema_with_a_valid_document_passes_our_prechecks(pair):
    schema, witness = pair
    jsonschema.Draft202012Validator(schema).validate(witness)  # the oracle: witness is valid
    check_json_schema(schema)
    assert has_finite_document(schema), schema
    capped = close_objects(cap_lengths(schema, DEFAULT_OUTPUT_LIMITS))
    assert has_finite_document(capped), capped


def _chain(links: int, wrapped: bool) -> dict:
    """``$defs`` a0 -> a1 -> ... -> a<links> (a string): each a bare ``$ref`` or an object
    whose required property refers to the next."""

    def link(i):
        ref = {"$ref": f"#/$defs/a{i + 1}"}
        return {"type": "object", "properties": {"x": ref}, "required": ["x"]} if wrapped else ref

    defs = {f"a{i}": link(i) for i in range(links)}
    defs[f"a{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("links", [5000, 20000])
def test_long_ref_chains_are_checked_in_linear_time(links, wrapped):
    """A chain of 5,000 links took the quadratic fixpoint over 120 s; now each subschema and
    reference is read once. The answer flips with the chain's end (a string, then ``false``),
    the oracle being ``jsonschema`` on the chain's one document (nested ``{"x": ...}`` around
    ``"s"``; checked on a shorter chain: its validator recurses)."""
    schema = _chain(links, wrapped)
    for end, expected in (({"type": "string"}, True), (False, False)):
        schema["$defs"][f"a{links}"] = end
        t0 = time.perf_counter()
        assert has_finite_document(schema) is expected
        assert time.perf_counter() - t0 < 1.0  # ~0.1 s for 20,000 links on a busy 2-core host
    short, doc = _chain(50, wrapped), "s"
    for _ in range(50 if wrapped else 0):
        doc = {"x": doc}
    jsonschema.Draft202012Validator(short).validate(doc)
    assert has_finite_document(short)


def _fixpoint(schema):
    """The previous implementation (a pass over the schema per round until nothing changes:
    quadratic on a chain), the reference the linear one must agree with."""
    if not isinstance(schema, dict):
        return schema is not False
    old = any(d in str(schema.get("$schema", "")) for d in ("draft-04", "draft-06", "draft-07"))
    memo, targets = {}, {}

    def ev(node):
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = resolve_pointer(schema, ref)
            if target is not None:
                targets.setdefault(ref, target)
                if not memo.get(ref, False):
                    return False
            if old:
                return True
        if node.get("enum") == []:
            return False
        if not all(ev(b) for b in node.get("allOf", [])):
            return False
        for k in ("anyOf", "oneOf"):
            if k in node and not any(ev(b) for b in node[k]):
                return False
        if "const" in node:
            return True
        types = node.get("type", ["object", "array", "string", "number", "null", "boolean"])
        return any(type_ok(node, t) for t in ([types] if isinstance(types, str) else types))

    def type_ok(node, t):
        if t == "object":
            props, extra = node.get("properties", {}), node.get("additionalProperties", True)
            return all(
                ev(props[n]) if n in props else bool(node.get("patternProperties")) or ev(extra)
                for n in node.get("required", [])
            )
        if t == "array":
            prefix, items = node.get("prefixItems", []), node.get("items", True)
            if isinstance(items, list):
                prefix, items = items, node.get("additionalItems", True)
            n = node.get("minItems", 0)
            if not all(
                ev(prefix[i] if i < len(prefix) else items) for i in range(min(n, len(prefix) + 1))
            ):
                return False
            return "contains" not in node or node.get("minContains", 1) == 0 or ev(node["contains"])
        return True

    while True:
        known, result, changed = len(targets), ev(schema), False
        for ref, target in list(targets.items()):
            if not memo.get(ref) and ev(target):
                memo[ref] = changed = True
        if not changed and len(targets) == known:
            return result


_DEFS = 3


def _any_schema(depth):
    """Schemas with and without finite documents: ``false``, ``enum: []``, required
    properties and items, references to definitions (recursive ones too), ``const``."""
    leaf = st.sampled_from(
        [True, False, {"type": "string"}, {"enum": []}, {"const": 1}, {"type": []}]
        + [{"$ref": f"#/$defs/d{i}"} for i in range(_DEFS)]
        + [{"$ref": "#"}, {"$ref": "#/$defs/missing"}]
    )
    if depth == 0:
        return leaf
    sub = _any_schema(depth - 1)
    subs = st.lists(sub, max_size=3)
    return st.one_of(
        leaf,
        st.builds(
            lambda p, r: {"type": "object", "properties": p, "required": r},
            st.dictionaries(st.sampled_from("abc"), sub, max_size=3),
            st.lists(st.sampled_from("abcd"), unique=True, max_size=3),
        ),
        st.builds(
            lambda i, n, pre, c: {
                "type": ["array", "null"][: 1 + (n == 3)],
                "items": i,
                "minItems": n,
                "prefixItems": pre,
                **({"contains": c} if c else {}),
            },
            sub,
            st.integers(0, 3),
            subs,
            st.none() | sub,
        ),
        st.builds(lambda b: {"allOf": b}, subs),
        st.builds(lambda b: {"anyOf": b}, subs),
        st.builds(lambda b, r: {"oneOf": b, "$ref": r}, subs, st.sampled_from(["#/$defs/d0", "#"])),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_any_schema(2), min_size=_DEFS, max_size=_DEFS),
    _any_schema(3),
    st.booleans(),
)
def test_linear_check_agrees_with_the_fixpoint(defs, root, draft7):
    """Random schemas, productive or not (recursive definitions, dead branches, refs in
    draft 7 where siblings are ignored): the same answer as the previous fixpoint."""
    schema = dict(root) if isinstance(root, dict) else {"allOf": [root]}
    schema["$defs"] = {f"d{i}": s for i, s in enumerate(defs)}
    if draft7:
        schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    assert has_finite_document(schema) == _fixpoint(schema), schema


def test_the_test_suites_schemas_agree_and_valid_instances_are_finite():
    """The JSON-Schema-Test-Suite's schemas (draft 2020-12) and the JSONSchemaBench sample:
    the same answer as the previous fixpoint, and True wherever ``jsonschema`` accepts one of
    the group's test documents."""
    for group in json_schema_test_suite():
        schema = group["schema"]
        assert has_finite_document(schema) == _fixpoint(schema), group["group_description"]
        if any(t["valid"] for t in group["tests"]):
            assert has_finite_document(schema), group["group_description"]
    for row in jsonschemabench_sample():
        assert has_finite_document(row["schema"]) == _fixpoint(row["schema"]), row["id"]
