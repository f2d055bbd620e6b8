"""Our own schema analyses tested like the backends: a schema ``jsonschema`` accepts a document
of must pass our pre-checks (the meta-schema check, the finite-document check, after the output
limits' rewrite too). Generated schemas come with a witness document built alongside (the
oracle validates it first, so a wrong witness fails the test, not our check); their definitions
refer to earlier ones and to themselves through optional properties, as real schemas do.

The fault this caught: an object whose required properties ``$ref`` two different definitions
was refused as "accepts no finite document" (the fixpoint stopped before the second reference
was ever met)."""

from __future__ import annotations

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
