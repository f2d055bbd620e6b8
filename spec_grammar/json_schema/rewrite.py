"""Rewrites of JSON schemas: a walk over every subschema (:func:`map_subschemas`, which the
adapters and :class:`~spec_grammar.specs.ToolCalls` use to fit schemas to what a library
takes), and node rewrites that keep a schema's meaning for backends that would otherwise
enforce less than it says."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jsonschema

__all__ = [
    "LITERAL_KEYWORDS",
    "const_within_enum",
    "enum_within_type",
    "map_subschemas",
    "rewrite_patterns",
    "split_by_type",
    "literal_as_schema",
    "ref_siblings_dropped",
]

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


def _json_equal(a: Any, b: Any) -> bool:
    """JSON-Schema equality (``1 == 1.0``, ``true != 1``): ``jsonschema``'s own."""
    try:
        from jsonschema._utils import equal
    except ImportError:  # pragma: no cover - a jsonschema without the helper
        return type(a) is type(b) and a == b
    return bool(equal(a, b))


def const_within_enum(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with ``const`` and ``enum`` side by side reduced to what both allow: JSON
    Schema asks for both, while xgrammar 0.2.9 and outlines-core 0.2.14 keep one
    (``{"const": "a", "enum": ["b"]}`` wrote ``"a"``). The ``const`` stays when the ``enum``
    lists it (the ``enum`` goes), else ``enum: []`` replaces both (nothing matches). Returns
    ``node`` itself when it has not both."""
    if "const" not in node or not isinstance(node.get("enum"), list):
        return node
    out = {k: v for k, v in node.items() if k != "enum"}
    if any(_json_equal(node["const"], v) for v in node["enum"]):
        return out
    del out["const"]
    out["enum"] = []
    return out


def rewrite_patterns(
    schema: Any,
    target: str,
    *,
    anchor: bool,
    why: str,
    property_patterns: bool = False,
    escapes: bool = True,
    refuses: str = "",
) -> tuple[Any, list[str]]:
    """``schema`` with every ``pattern`` (and, with ``property_patterns``, every
    ``patternProperties`` name) replaced by :func:`~spec_grammar.json_schema.pattern.translate`
    ``(pattern, target)``, wrapped as ``^(?:R)$`` when ``anchor`` (for libraries that search)
    or ``(?:R)`` otherwise. A pattern the translation does not support is left out (a
    ``patternProperties`` entry: its name is kept as written) with one warning line
    ``"pattern at <pointer>: <feature> ...; <why>"`` each. With ``escapes=False`` (see
    :func:`~spec_grammar.json_schema.pattern.translate_ex`) a pattern whose strings may hold a
    character JSON escapes gets a line ``"pattern:refuses at <pointer>: <refuses>"``. Returns
    ``(schema, warnings)``; ``schema`` is the same object when nothing changed."""
    from .pattern import NOTHING, UnsupportedPattern, translate_ex

    notes: list[str] = []

    def conv(pattern: str, where: str, keyword: str) -> str | None:
        try:
            r, dropped = translate_ex(pattern, target, escapes)
        except UnsupportedPattern as e:
            notes.append(f"{keyword} at {where or '/'}: {e.feature} ({pattern!r:.80}) {why}")
            return None
        except re.error:  # not a Python regex: the library reports it
            return pattern
        if dropped:
            notes.append(f"{keyword}:refuses at {where or '/'}: {refuses}")
        if r is None:  # no string matches: a negated class of every character says so
            r = NOTHING
        return f"^(?:{r})$" if anchor else f"(?:{r})"

    def node(n: dict[str, Any], where: str) -> dict[str, Any]:
        out = n
        if isinstance(n.get("pattern"), str):
            r = conv(n["pattern"], where, "pattern")
            out = {k: v for k, v in n.items() if k != "pattern"}
            if r is not None:
                out["pattern"] = r
        pp = n.get("patternProperties")
        if property_patterns and isinstance(pp, dict):
            new = {}
            for name, sub in pp.items():
                r = conv(name, f"{where}/patternProperties", "patternProperties")
                new[name if r is None else r] = sub
            out = {**out, "patternProperties": new}
        return out

    return map_subschemas(schema, node), notes


_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")


def split_by_type(node: dict[str, Any]) -> dict[str, Any] | None:
    """``node`` without ``type`` whose type-specific keywords (``minLength``, ``items``,
    ``properties`` ...) are moved into an ``anyOf`` with one typed branch per JSON type they
    constrain, plus one branch of every other type: the same instances pass (a type-specific
    keyword constrains its own type only), and libraries that apply such keywords only next to
    ``type`` (xgrammar 0.2.9 compiled ``{"items": ...}`` to arrays only, and ignored
    ``{"minLength": 2}``) now enforce them. Returns ``node`` itself when it has ``type``,
    ``enum`` / ``const`` or no type-specific keyword, and None when it cannot be split without
    nesting combinators the library merges poorly (it has ``anyOf``, ``oneOf``, ``allOf``,
    ``$ref`` or ``$dynamicRef`` already)."""
    from .strict import TYPE_KEYWORDS

    if any(k in node for k in ("type", "enum", "const")):
        return node
    groups: dict[str, dict[str, Any]] = {}
    for k, v in node.items():
        if k in TYPE_KEYWORDS:
            groups.setdefault(TYPE_KEYWORDS[k], {})[k] = v
    if not groups:
        return node
    if any(k in node for k in ("anyOf", "oneOf", "allOf", "$ref", "$dynamicRef")):
        return None
    out = {k: v for k, v in node.items() if k not in TYPE_KEYWORDS}
    branches: list[Any] = [{"type": t, **kws} for t, kws in groups.items()]
    others = [t for t in _JSON_TYPES if t not in groups]
    if others:
        branches.append({"type": others})
    out["anyOf"] = branches
    return out


def literal_as_schema(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with a ``const`` (or ``enum``) holding objects or arrays spelled as the schema
    that matches exactly that value (``{"type": "object", "properties": {k: {"const": v}},
    "required": [...], "additionalProperties": false}``; arrays with ``prefixItems``,
    ``items: false`` and ``minItems``), ``enum`` as an ``anyOf`` of those: the same instances
    pass, and the library writes them with the spec's separators (xgrammar 0.2.9 wrote such
    literals compactly, refusing ``[{"foo": "bar"}]`` under ``", "`` / ``": "``). Returns
    ``node`` itself when its literals are scalars, or when it has ``anyOf`` already."""

    def spell(v: Any) -> Any:
        if isinstance(v, dict):
            return {
                "type": "object",
                "properties": {k: spell(x) for k, x in v.items()},
                "required": list(v),
                "additionalProperties": False,
            }
        if isinstance(v, list):
            return {
                "type": "array",
                "prefixItems": [spell(x) for x in v],
                "items": False,
                "minItems": len(v),
            }
        return {"const": v}

    compound = (dict, list)
    if "const" in node and isinstance(node["const"], compound):
        out = {k: v for k, v in node.items() if k != "const"}
        if "anyOf" in out:
            return node
        out["anyOf"] = [spell(node["const"])]
        return out
    enum = node.get("enum")
    if (
        isinstance(enum, list)
        and any(isinstance(v, compound) for v in enum)
        and "anyOf" not in node
    ):
        out = {k: v for k, v in node.items() if k != "enum"}
        out["anyOf"] = [spell(v) for v in enum]
        return out
    return node


_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
_KEPT_NEXT_TO_REF = ("$ref", "definitions", "$defs", "$id", "id", "$schema")


def ref_siblings_dropped(schema: Any) -> Any:
    """``schema`` with the keywords next to each ``$ref`` removed when its ``$schema`` names
    draft 3 to 7, where "all other properties in a $ref object MUST be ignored" (draft-07
    Core, section 8.3); the libraries apply them as draft 2019-09+ does (llguidance 1.9 refused
    ``true`` for a draft-04 ``{"$ref": ..., "type": "object"}``). Definitions, ids and
    ``$schema`` stay (references resolve against them). Returns ``schema`` itself otherwise."""
    if not isinstance(schema, dict) or not any(
        d in str(schema.get("$schema", "")) for d in _OLD_DRAFTS
    ):
        return schema

    def node(n: dict[str, Any], _where: str) -> dict[str, Any]:
        if isinstance(n.get("$ref"), str) and any(k not in _KEPT_NEXT_TO_REF for k in n):
            return {k: v for k, v in n.items() if k in _KEPT_NEXT_TO_REF}
        return n

    return map_subschemas(schema, node)
