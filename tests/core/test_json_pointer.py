"""One reader of local ``$ref`` pointers (:func:`spec_grammar.json_pointer.resolve_pointer`),
checked against ``jsonschema``'s own resolution: for each reference, the subschema we find is
the one ``jsonschema`` applies (its ``const`` is the only value it accepts through the
reference)."""

from __future__ import annotations

import jsonschema
import pytest

from spec_grammar.json_pointer import resolve_pointer
from spec_grammar.json_schema.check import has_finite_document
from spec_grammar.limits import json_nesting_depth

DEFS = {
    "a/b": {"const": 1},
    "~1": {"const": 2},
    "~": {"const": 3},
    "%": {"const": 4},
    "a b": {"const": 5},
    "list": {"anyOf": [{"const": 6}, {"const": 7}]},
    "%25": {"const": 8},
}
REFS = {
    "#/$defs/a~1b": 1,
    "#/$defs/~01": 2,  # ~0 then 1: "~1", not "/"
    "#/$defs/%7E01": 2,  # percent-decoded first, then ~0
    "#/$defs/~0": 3,
    "#/$defs/%25": 4,
    "#/$defs/a%20b": 5,
    "#/$defs/list/anyOf/1": 7,
    "#/$defs/%2525": 8,
    "#/$defs/a%2Fb": None,  # %2F decodes to a separator: "a", then "b"
}


@pytest.mark.parametrize("ref", list(REFS))
def test_escapes_resolve_as_jsonschema_does(ref):
    schema = {"$defs": DEFS, "$ref": ref}
    target = resolve_pointer(schema, ref)
    assert (target or {}).get("const") == REFS[ref]
    if REFS[ref] is None:
        return
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(REFS[ref])
    assert not any(validator.is_valid(v) for v in range(1, 9) if v != REFS[ref])


@pytest.mark.parametrize(
    "ref",
    ["other.json#/a", "#foo", "#/$defs/list/anyOf/01", "#/$defs/list/anyOf/2", "#/missing", "x"],
)
def test_what_names_nothing_is_none(ref):
    """Remote references, anchors, indexes with a leading zero or past the end, absent keys."""
    assert resolve_pointer({"$defs": DEFS}, ref) is None


def test_root_and_every_caller_reads_the_same_pointer():
    """``#`` is the root; the nesting measure and the finite-document check follow the
    escaped reference to the same target (a deep one; then ``false``)."""
    root = {"$defs": {"a/b%": {"items": {"items": {}}}}, "$ref": "#/$defs/a~1b%25"}
    assert resolve_pointer(root, "#") is root
    assert json_nesting_depth(root) > json_nesting_depth({"$defs": {}, "x": {"items": {}}})
    assert has_finite_document(root)
    root["$defs"]["a/b%"] = False
    assert not has_finite_document(root)
