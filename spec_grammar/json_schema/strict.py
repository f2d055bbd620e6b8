"""Which JSON-Schema keywords of a schema a backend would not enforce (strict mode).

Grammar engines cover only part of JSON Schema and most of them silently drop what they cannot
express (xgrammar ignores ``uniqueItems``, outlines-core ignores ``minProperties``, ...), so a
"valid" output may break the schema. Each backend class declares what its library does not
enforce in a :class:`KeywordSupport`; :func:`unenforced_keywords` walks a schema and lists every
use of such a keyword. :meth:`GrammarBackend.compile <spec_grammar.protocol.GrammarBackend.compile>`
then refuses the schema when ``JsonSchema(..., strict=True)``
(:class:`~spec_grammar.errors.UnsupportedGrammarError`) and otherwise attaches one warning per
ignored keyword to the :class:`~spec_grammar.protocol.CompiledGrammar`.

The declarations are kept honest by ``tests/test_reliability_strict.py``: every group of the
JSON-Schema-Test-Suite that a backend compiles in strict mode must reject every instance
``jsonschema`` rejects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "KeywordSupport",
    "unenforced_keywords",
    "TYPE_KEYWORDS",
    "REMOTE_REF",
    "REQUIRED_UNDECLARED",
    "LENGTH_WITH_PATTERN",
    "NOT_CONTEXT_FREE_KEYWORDS",
]

TYPE_KEYWORDS: Mapping[str, str] = {
    **dict.fromkeys(("minLength", "maxLength", "pattern"), "string"),
    **dict.fromkeys(
        ("multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"), "number"
    ),
    **dict.fromkeys(
        (
            "items",
            "prefixItems",
            "additionalItems",
            "minItems",
            "maxItems",
            "uniqueItems",
            "contains",
            "minContains",
            "maxContains",
            "unevaluatedItems",
        ),
        "array",
    ),
    **dict.fromkeys(
        (
            "properties",
            "required",
            "additionalProperties",
            "patternProperties",
            "minProperties",
            "maxProperties",
            "propertyNames",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
            "unevaluatedProperties",
        ),
        "object",
    ),
}
"""Keywords that constrain one JSON type only (instances of other types pass them)."""

_OTHER_KEYWORDS = frozenset(
    {
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
        "format",
    }
)

REMOTE_REF = "$ref:uri"
"""Pseudo-keyword reported for a ``$ref`` / ``$dynamicRef`` that is not a local JSON pointer
(``#`` or ``#/...``): an anchor, a relative or absolute URI, resolved against ``$id``."""

REQUIRED_UNDECLARED = "required:undeclared"
"""Pseudo-keyword reported for a ``required`` name that the same subschema's ``properties``
does not define."""

LENGTH_WITH_PATTERN = "length:with-pattern"
"""Pseudo-keyword reported for a ``minLength`` / ``maxLength`` in a subschema that also has a
``pattern`` or a ``format``."""

NOT_CONTEXT_FREE_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "$dynamicRef",
    "$recursiveRef",  # draft 2019-09's form of $dynamicRef
)
"""Keywords that none of the built-in libraries turns into grammar (negation, conditionals,
counting and evaluation-dependent applicators): each adapter declares them unenforced."""

# Keywords whose value is one subschema, a list of subschemas, or a name -> subschema map.
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class KeywordSupport:
    """What a backend's library leaves unenforced in JSON schemas.

    Attributes:
        unenforced: keyword (or :data:`REMOTE_REF`) -> why the library does not enforce it.
            A keyword listed here may still be partly enforced; listing it means "not always".
        untyped: why type-specific keywords (:data:`TYPE_KEYWORDS`) are ignored in a subschema
            that has no ``type``; ``None`` when the library enforces them there too.
        restricted: keyword -> why the library refuses some documents the keyword allows (the
            other side of the same promise: a valid document refused). Reported as
            ``"<keyword>:refuses at <pointer>: <reason>"``; strict mode refuses them too.
    """

    unenforced: Mapping[str, str] = field(default_factory=dict)
    untyped: str | None = None
    restricted: Mapping[str, str] = field(default_factory=dict)


def unenforced_keywords(schema: Any, support: KeywordSupport) -> list[str]:
    """One line per use of a keyword ``support`` says is not enforced, as
    ``"<keyword> at <JSON pointer>: <reason>"``, in document order (at most one line per
    keyword and location). ``schema``: a JSON schema (dict or bool); unknown keywords and
    annotations are not reported (they constrain nothing)."""
    out: list[str] = []
    _walk(schema, "", support, out, _referenced(schema))
    return list(dict.fromkeys(out))


_VACUOUS = {("uniqueItems", False), ("minProperties", 0)}
"""Keyword values that constrain nothing: no backend needs to enforce them."""


def _referenced(schema: Any) -> frozenset[str] | None:
    """Every ``$ref`` of ``schema`` when all are plain local JSON pointers (``#/...``), else
    None (an anchor, a URI, a percent-escape, ``$dynamicRef`` or ``$recursiveRef`` may reach
    any definition: then every definition counts as used). Iterative."""
    refs: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "$dynamicRef" in node or "$recursiveRef" in node:
                return None
            ref = node.get("$ref")
            if isinstance(ref, str):
                if not (ref == "#" or ref.startswith("#/")) or "%" in ref:
                    return None
                refs.add(ref[1:])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(refs)


def _used(where: str, refs: frozenset[str] | None) -> bool:
    """The definition at pointer ``where`` can apply: some ``$ref`` points at it or into it."""
    return refs is None or any(r == where or r.startswith(where + "/") for r in refs)


def _walk(
    schema: Any,
    where: str,
    support: KeywordSupport,
    out: list[str],
    refs: frozenset[str] | None = None,
) -> None:
    if not isinstance(schema, dict):
        return
    at = where or "/"
    typed = "type" in schema or "enum" in schema or "const" in schema
    for key, value in schema.items():
        if key in ("$ref", "$dynamicRef"):
            local = isinstance(value, str) and (value == "#" or value.startswith("#/"))
            name = key if local else REMOTE_REF
        elif key in TYPE_KEYWORDS or key in _OTHER_KEYWORDS:
            name = key
        else:
            name = None
        if isinstance(value, (bool, int)) and (key, value) in _VACUOUS:
            name = None
        if key == "required" and isinstance(value, list):
            props = schema.get("properties")
            if any(not isinstance(props, dict) or n not in props for n in value):
                name = REQUIRED_UNDECLARED if REQUIRED_UNDECLARED in support.unenforced else name
        if (
            key in ("minLength", "maxLength")
            and ("pattern" in schema or "format" in schema)
            and LENGTH_WITH_PATTERN in support.unenforced
        ):
            name = LENGTH_WITH_PATTERN
        if name is not None and name in support.restricted:
            out.append(f"{name}:refuses at {at}: {support.restricted[name]}")
        if name is not None:
            if name in support.unenforced:
                out.append(f"{name} at {at}: {support.unenforced[name]}")
            elif support.untyped and key in TYPE_KEYWORDS and not typed:
                out.append(f"{name} at {at} (no `type` next to it): {support.untyped}")
        _recurse(key, value, f"{where}/{key}", support, out, refs)


def _recurse(
    key: str,
    value: Any,
    where: str,
    support: KeywordSupport,
    out: list[str],
    refs: frozenset[str] | None,
) -> None:
    if key in _ONE:
        _walk(value, where, support, out, refs)
    elif key in _LIST and isinstance(value, list):
        for i, sub in enumerate(value):
            _walk(sub, f"{where}/{i}", support, out, refs)
    elif key in _MAP and isinstance(value, dict):
        for name, sub in value.items():
            at = f"{where}/{_escape(name)}"
            # a definition no $ref reaches constrains nothing
            if key not in ("$defs", "definitions") or _used(at, refs):
                _walk(sub, at, support, out, refs)
    elif key == "dependencies" and isinstance(value, dict):
        for name, sub in value.items():
            _walk(sub, f"{where}/{_escape(name)}", support, out, refs)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
