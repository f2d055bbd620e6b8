"""The oracle every JSON-Schema check here is measured against: ``jsonschema``'s validator of a
schema, read as JSON Schema's own dialect wants (the conformance suite, the differential tests
and the post-check of outputs, :mod:`spec_grammar.output_check`, all use it)."""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.validators import validator_for

__all__ = ["oracle", "ecma_end"]


def ecma_end(pattern: str) -> str:
    """``pattern`` with each ``$`` anchor (outside a class, not escaped) written ``\\Z``: in
    ECMA 262, the dialect JSON Schema names for ``pattern``, ``$`` matches at the end of the
    string only, while Python's ``re`` (which ``jsonschema`` uses) also matches before a final
    newline."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]" or (out and out[-1] in ("[", "[^"))
        elif ch == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                out.append("[^")
                i += 2
                continue
        elif ch == "$":
            ch = "\\Z"
        out.append(ch)
        i += 1
    return "".join(out)


def _ecma_keywords(cls: Any) -> Any:
    """``cls`` with ``pattern`` / ``patternProperties`` reading ``$`` as ECMA 262 does."""
    base = cls.VALIDATORS

    def pattern(validator, patrn, instance, schema):
        yield from base["pattern"](validator, ecma_end(patrn), instance, schema)

    def pattern_properties(validator, pp, instance, schema):
        yield from base["patternProperties"](
            validator, {ecma_end(k): v for k, v in pp.items()}, instance, schema
        )

    return jsonschema.validators.extend(
        cls, {"pattern": pattern, "patternProperties": pattern_properties}
    )


_ORACLES: dict[Any, Any] = {}


def oracle(schema: Any) -> jsonschema.protocols.Validator:
    """The ``jsonschema`` validator of ``schema``: the draft its ``$schema`` names, Draft
    2020-12 otherwise; ``format`` is an annotation (the Draft 2020-12 default); ``$`` in a
    pattern matches at the end only (:func:`ecma_end`)."""
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    if cls not in _ORACLES:
        _ORACLES[cls] = _ecma_keywords(cls)
    return _ORACLES[cls](schema)
