"""Checks on JSON schemas before a backend sees them, so a bad schema fails with the same clear
message on every backend."""

from __future__ import annotations

import warnings
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from ..errors import GrammarCompileError

__all__ = ["check_json_schema", "has_finite_document"]


def check_json_schema(schema: Any) -> None:
    """Raise :class:`GrammarCompileError` unless ``schema`` is valid under its meta-schema (the
    draft its ``$schema`` names, Draft 2020-12 by default). The message gives the JSON path."""
    if isinstance(schema, bool):
        return
    try:
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    except Exception as e:  # an unknown $schema URI
        raise GrammarCompileError(f"invalid JSON Schema: {e}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the regex format checker warns on odd patterns
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise GrammarCompileError(f"invalid JSON Schema at {where}: {error.message[:300]}")


_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")


def has_finite_document(schema: Any) -> bool:
    """False when no valid document of ``schema`` is finite: every path to a valid document
    runs through a required property or a required array item whose schema refers back to
    itself (``{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}``) or through
    ``false`` / ``enum: []``. Grammar engines given such a schema compile a grammar whose
    matcher can only go on forever (or exhaust the library: llguidance 1.9 stops with "Too many
    items"), so it is refused up front.

    Least fixed point of "has a finite document" over the subschemas (the productive
    nonterminals of a grammar: Hopcroft & Ullman, *Introduction to Automata Theory*, 1979,
    section 4.4): a subschema is productive when every ``allOf`` branch, some ``anyOf`` /
    ``oneOf`` branch, its local ``$ref`` target and one of its allowed types are; an object
    type needs every required property's schema, an array type the schemas of its first
    ``minItems`` items and its ``contains``. Everything else (string, number and count bounds,
    ``not``, ``if``, remote references) is taken as satisfiable, so the answer is False only
    when no finite document exists."""
    if not isinstance(schema, dict):
        return schema is not False
    old = any(d in str(schema.get("$schema", "")) for d in _OLD_DRAFTS)
    memo: dict[str, bool] = {}
    targets: dict[str, Any] = {}

    def resolve(ref: str) -> Any:
        node: Any = schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def ev(node: Any, depth: int = 0) -> bool:
        if not isinstance(node, dict) or depth > 200:
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = resolve(ref)
            if target is not None:
                targets.setdefault(ref, target)
                if not memo.get(ref, False):
                    return False
            if old:  # draft 4-7: keywords next to $ref are ignored
                return True
        if node.get("enum") == []:
            return False
        if not all(ev(b, depth + 1) for b in node.get("allOf", []) or []):
            return False
        for k in ("anyOf", "oneOf"):
            branches = node.get(k)
            if isinstance(branches, list) and not any(ev(b, depth + 1) for b in branches):
                return False
        types = node.get("type", ["object", "array", "string", "number", "null", "boolean"])
        types = [types] if isinstance(types, str) else types
        if "const" in node:
            return True
        return any(_type_ok(node, t, ev, depth) for t in types) if isinstance(types, list) else True

    # Each pass evaluates the root (which registers the references it meets) and marks the
    # targets found productive. An evaluation stops at the first unproductive reference of an
    # `allOf` / `required` list, so a reference after it is only met once the earlier one is
    # marked: the loop ends when a pass neither marks a target nor meets a new one (both are
    # finite), not before (the required $refs to two definitions were refused).
    while True:
        known = len(targets)
        result = ev(schema)
        changed = False
        for ref, target in list(targets.items()):
            if not memo.get(ref) and ev(target):
                memo[ref] = changed = True
        if not changed and len(targets) == known:
            return result


def _type_ok(node: dict[str, Any], t: str, ev: Any, depth: int) -> bool:
    if t == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        for name in node.get("required", []) if isinstance(node.get("required"), list) else []:
            if name in props:
                if not ev(props[name], depth + 1):
                    return False
            elif not node.get("patternProperties") and not ev(extra, depth + 1):
                return False
        return True
    if t == "array":
        n = node.get("minItems", 0)
        n = int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else 0
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        for i in range(min(n, len(prefix) + 1)):
            if not ev(prefix[i] if i < len(prefix) else items, depth + 1):
                return False
        if "contains" in node and node.get("minContains", 1) != 0:
            return ev(node["contains"], depth + 1)
        return True
    return True
