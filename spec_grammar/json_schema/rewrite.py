"""Rewrites of JSON schemas: a walk over every subschema (:func:`map_subschemas`, which the
adapters and :class:`~spec_grammar.specs.ToolCalls` use to fit schemas to what a library
takes), and node rewrites that keep a schema's meaning for backends that would otherwise
enforce less than it says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema

__all__ = ["LITERAL_KEYWORDS", "enum_within_type", "map_subschemas"]

_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER

LITERAL_KEYWORDS = ("const", "enum", "default", "examples")
"""Keywords whose values are JSON values, not schemas: a walk leaves them as they are."""

_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose values map names (not keywords) to schemas."""


def map_subschemas(
    schema: Any, fn: Callable[[dict[str, Any], str], dict[str, Any]], where: str = ""
) -> Any:
    """``schema`` with ``fn(node, pointer)`` applied to every object in it, the outer ones first
    (``fn`` sees a node before its subschemas are walked; ``pointer`` is the node's JSON pointer
    from ``where``, names unescaped). Values of :data:`LITERAL_KEYWORDS` are left alone, and
    the keys of ``properties``, ``$defs`` and the like are names, never walked as keywords.
    Returns ``schema`` itself (the same object) where ``fn`` changed nothing; exceptions of
    ``fn`` propagate."""
    if isinstance(schema, list):
        items = [map_subschemas(x, fn, f"{where}/{i}") for i, x in enumerate(schema)]
        return schema if all(a is b for a, b in zip(items, schema)) else items
    if not isinstance(schema, dict):
        return schema
    node = fn(schema, where)
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in LITERAL_KEYWORDS:
            out[k] = v
        elif k in _NAME_MAPS and isinstance(v, dict):
            subs = {n: map_subschemas(sub, fn, f"{where}/{k}/{n}") for n, sub in v.items()}
            out[k] = v if all(subs[n] is v[n] for n in v) else subs
        else:
            out[k] = map_subschemas(v, fn, f"{where}/{k}")
    return node if all(out[k] is node[k] for k in node) else out


def enum_within_type(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``enum`` values (and ``const``) kept only where they match its
    ``type``: JSON Schema asks for both, while xgrammar 0.2.9 and outlines-core 0.2.14 let any
    listed value through (``{"type": "string", "enum": ["a", null]}`` wrote ``null``). A
    ``const`` of another type becomes ``enum: []`` (nothing matches). Types are checked as
    Draft 2020-12 does (``jsonschema``'s type checker: ``1.0`` is an integer, ``true`` is not).
    Returns ``node`` itself when nothing changes, or when ``type`` names an unknown type."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not ("enum" in node or "const" in node):
        return node
    try:

        def fits(value: Any) -> bool:
            return any(_TYPES.is_type(value, t) for t in types)

        if "const" in node and not fits(node["const"]):
            out = {k: v for k, v in node.items() if k != "const"}
            out["enum"] = []
            return out
        enum = node.get("enum")
        if isinstance(enum, list) and not all(fits(v) for v in enum):
            return {**node, "enum": [v for v in enum if fits(v)]}
    except jsonschema.exceptions.UnknownType:
        pass
    return node
