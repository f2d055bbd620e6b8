"""vLLM's rule for JSON objects: its default backend (xgrammar, ``strict_mode=True``) refuses
properties a schema does not list unless the schema allows them explicitly
(``additionalProperties`` / ``patternProperties`` / ``unevaluatedProperties``). Small models
write extra keys until the token limit where a schema leaves objects open, so under vLLM our
backends close them the same way by default (``$SPEC_GRAMMAR_VLLM_OBJECTS=open`` keeps the
schema as written). Closing only narrows the language: every output still validates against
the schema as written.
"""

from __future__ import annotations

import os
from typing import Any

from spec_grammar.json_schema.rewrite import map_subschemas

__all__ = ["OBJECTS_ENV", "close_objects", "objects_closed"]

OBJECTS_ENV = "SPEC_GRAMMAR_VLLM_OBJECTS"
"""``closed`` (default: vLLM's xgrammar rule) or ``open`` (the schema as written)."""

# a node with any of these decides extra properties itself, or is combined with others
# (closing a branch of allOf / a $ref target's user would refuse the other branch's keys)
_OPEN_KEYWORDS = frozenset(
    {
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
        "allOf",
        "anyOf",
        "oneOf",
        "$ref",
        "if",
        "dependentSchemas",
        "dependencies",
    }
)


def objects_closed() -> bool:
    """Whether :data:`OBJECTS_ENV` asks for vLLM's rule. Raises ``ValueError`` for a value
    other than ``closed`` / ``open``."""
    raw = os.environ.get(OBJECTS_ENV, "").strip() or "closed"
    if raw not in ("closed", "open"):
        raise ValueError(f"{OBJECTS_ENV}={raw!r}: expected closed or open")
    return raw == "closed"


def close_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on each object schema that lists
    ``properties`` and says nothing about others, outside ``allOf`` and ``$defs`` (a
    definition may be combined where it is used); ``schema`` itself when nothing changes."""

    def close(node: dict[str, Any], where: str) -> dict[str, Any]:
        if "properties" not in node or _OPEN_KEYWORDS & node.keys():
            return node
        parts = where.split("/")
        if "allOf" in parts or "$defs" in parts or "definitions" in parts:
            return node
        return {**node, "additionalProperties": False}

    return map_subschemas(schema, close)
