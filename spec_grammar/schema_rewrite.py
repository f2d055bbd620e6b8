"""Rewrites of one JSON-schema node that keep its meaning, for backends that would otherwise
enforce less than the schema says."""

from __future__ import annotations

from typing import Any

import jsonschema

__all__ = ["enum_within_type"]

_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER


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
