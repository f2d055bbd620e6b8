"""vLLM's rule for JSON objects (``spec_grammar.integrations.vllm.objects``), without vLLM.
Oracle: jsonschema on documents, under the schema as written and as closed."""

from __future__ import annotations

import jsonschema
import pytest

from spec_grammar.integrations.vllm.objects import OBJECTS_ENV, close_objects, objects_closed

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"allOf": [{"properties": {"y": {"type": "integer"}}}, {"properties": {"z": {}}}]},
        "c": {"type": "object", "properties": {"k": {}}, "additionalProperties": True},
        "d": {"$ref": "#/$defs/D"},
    },
    "$defs": {"D": {"properties": {"w": {}}}},
}


@pytest.mark.parametrize(
    ("doc", "as_written", "closed"),
    [
        ({"a": {"x": 1}}, True, True),
        ({"a": {"x": 1}, "extra": 1}, True, False),  # the root closed
        ({"a": {"x": 1, "extra": 1}}, True, False),  # nested objects closed
        ({"b": {"y": 1, "z": 2}}, True, True),  # allOf branches left open: they combine
        ({"c": {"k": 1, "more": 2}}, True, True),  # additionalProperties as written
        ({"d": {"w": 1, "v": 2}}, True, True),  # $defs untouched (combined where used)
    ],
)
def test_closing_only_refuses_unlisted_properties(doc, as_written, closed):
    jsonschema.Draft202012Validator.check_schema(close_objects(SCHEMA))
    assert jsonschema.Draft202012Validator(SCHEMA).is_valid(doc) is as_written
    assert jsonschema.Draft202012Validator(close_objects(SCHEMA)).is_valid(doc) is closed


def test_a_schema_without_open_objects_is_returned_as_is():
    schema = {"type": "array", "items": {"type": "string"}}
    assert close_objects(schema) is schema


def test_the_rule_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.delenv(OBJECTS_ENV, raising=False)
    assert objects_closed()
    monkeypatch.setenv(OBJECTS_ENV, "open")
    assert not objects_closed()
    monkeypatch.setenv(OBJECTS_ENV, "shut")
    with pytest.raises(ValueError, match=OBJECTS_ENV):
        objects_closed()
