"""Output limits: bounds on what a JSON schema leaves open, so that a small model cannot write
one value until ``max_new_tokens`` (digits, whitespace, string characters or array items
repeated without end) and the user gets no document at all.

:class:`OutputLimits` is carried by :class:`~spec_grammar.specs.JsonSchema` (and
:class:`~spec_grammar.specs.ToolCalls`) as ``limits``. The grammar enforces them:

- ``max_string_length``, ``max_items`` and ``closed_objects`` are schema rewrites
  (:func:`cap_lengths`, :func:`close_objects`, run by
  :func:`~spec_grammar.compile.compile_spec` for each backend that takes them,
  :attr:`~spec_grammar.protocol.GrammarBackend.schema_caps`): ``maxLength`` / ``maxItems``
  added to each subschema typed ``string`` / ``array`` that sets none, ``additionalProperties:
  false`` to objects that declare properties and say nothing of others. A user's own bound is
  never touched, and a cap is raised to ``minLength`` / ``minItems`` (``minContains``) where
  those ask for more, so the rewritten schema keeps documents whenever the user's does and is
  a subset of it (adding a keyword only removes instances).
- ``max_digits`` and ``max_whitespace`` are enforced by each adapter in its library's own
  terms (numeric bounds from :func:`bound_numbers`, a number regex, ``max_whitespace_cnt``, a
  whitespace pattern); a backend that cannot has its compile declare it
  (:attr:`~spec_grammar.protocol.GrammarBackend.output_limits`).

Values the schema leaves untyped (``{}``, ``true``, the values of additional properties) and
strings with a ``pattern`` or ``format`` are not capped by the rewrite: there is no ``type`` to
hang a bound on, or the shape is the user's.

SGLang's ``max_whitespace_cnt`` and xgrammar's ``max_whitespace_cnt`` are the whitespace limit
here; the defaults (:data:`DEFAULT_OUTPUT_LIMITS`) were chosen on the shared e2e prompts
(``docs/output-limits.md``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .rewrite import map_subschemas

__all__ = [
    "limit_applies",
    "OutputLimits",
    "DEFAULT_OUTPUT_LIMITS",
    "LIMIT_FIELDS",
    "cap_lengths",
    "close_objects",
    "bound_numbers",
    "types_of",
    "out_of_range_number",
    "largest_string_enum",
]


class OutputLimits(BaseModel):
    """Per-request bounds the grammar enforces on a JSON output (None = no bound).

    Attributes:
        max_whitespace: longest run of whitespace between JSON tokens (characters; only
            ``whitespace="flexible"`` allows runs at all: ``spaced`` writes one space,
            ``compact`` none). Like SGLang's / xgrammar's ``max_whitespace_cnt``.
        max_digits: most digits in each digit run of a number: the integer part, the fraction
            part (and the exponent where a library writes one), each at most this many.
        max_string_length: ``maxLength`` (characters) of every ``type: string`` subschema that
            sets none.
        max_items: ``maxItems`` of every ``type: array`` subschema that sets none.
        closed_objects: ``True``: an object subschema that declares ``properties`` and says
            nothing of other names takes no others (``additionalProperties: false``, see
            :func:`close_objects`; what OpenAI's strict structured outputs ask of every schema).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_whitespace: int | None = Field(None, ge=1)
    max_digits: int | None = Field(None, ge=1)
    max_string_length: int | None = Field(None, ge=0)
    max_items: int | None = Field(None, ge=0)
    closed_objects: bool | None = None

    def is_empty(self) -> bool:
        """No bound set (an explicit "no limits")."""
        return all(getattr(self, k) in (None, False) for k in LIMIT_FIELDS)


from .limit_defaults import DEFAULT_LIMIT_VALUES  # noqa: E402 (plain values, for --help)

LIMIT_FIELDS = tuple(OutputLimits.model_fields)
"""The limit names, as :class:`OutputLimits` fields, CLI flags (``--max-digits``) and batch
line keys spell them."""

DEFAULT_OUTPUT_LIMITS = OutputLimits(**DEFAULT_LIMIT_VALUES)
"""What :func:`spec_grammar.worker.generate` and ``spec-grammar generate`` apply to a JSON
schema or tool list that carries no limits of its own (measured: ``docs/output-limits.md``).
No string-length cap by default: it completed no more outputs in the measurement, and xgrammar
0.2.9 writes a length-bounded string without escape sequences (a declared refusal of every
string holding a quote or a backslash)."""


def types_of(node: dict[str, Any]) -> set[str]:
    """The JSON types a subschema's ``type`` names (empty when it names none)."""
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _count(node: dict[str, Any], key: str) -> int:
    v = node.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else 0


def cap_lengths(schema: Any, limits: OutputLimits | None) -> Any:
    """``schema`` with ``maxLength = max(limits.max_string_length, minLength)`` added to every
    subschema whose ``type`` names ``string`` and that has no ``maxLength``, and ``maxItems =
    max(limits.max_items, minItems, minContains)`` to every one naming ``array`` without
    ``maxItems``. Subschemas holding ``const`` / ``enum`` are left alone (their values are
    bounded already). Returns ``schema`` itself when nothing changes (no limits, no such
    subschema)."""
    if limits is None or (limits.max_string_length is None and limits.max_items is None):
        return schema

    def node(n: dict[str, Any], _where: str) -> dict[str, Any]:
        types = types_of(n)
        if not types or "const" in n or "enum" in n:
            return n
        out = n
        if (
            "string" in types
            and limits.max_string_length is not None
            and not any(k in n for k in ("maxLength", "pattern", "format"))
        ):
            out = {**out, "maxLength": max(limits.max_string_length, _count(n, "minLength"))}
        if "array" in types and limits.max_items is not None and "maxItems" not in n:
            floor = max(_count(n, "minItems"), _count(n, "minContains") if "contains" in n else 0)
            out = {**out, "maxItems": max(limits.max_items, floor)}
        return out

    return map_subschemas(schema, node)


_OPEN_SIBLINGS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "propertyNames",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "$dynamicRef",
    "if",
)
"""Keywords next to ``properties`` that say something of other names or may bring properties
from elsewhere: such an object is left open."""

_CONJUNCTIVE = ("allOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")
"""Applicators inside which a closed object would not only remove instances: an ``allOf``
branch closed refuses its siblings' names, and ``oneOf`` / ``not`` are not monotone (a
``oneOf`` branch that stops matching can make a document valid)."""

_INSIDE = re.compile(r"/(" + "|".join(_CONJUNCTIVE) + r")(/|$)")
_DEFS = re.compile(r"/(\$defs|definitions)(/|$)")


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` added to every subschema that declares
    ``properties`` (at least one) and none of :data:`_OPEN_SIBLINGS`, whose ``required`` names
    are all declared and whose ``minProperties`` the declared names can meet, and that does not
    sit inside one of :data:`_CONJUNCTIVE` (nor, when the schema uses any of them, inside
    ``$defs`` / ``definitions``, which a reference may reach from there). Only instances go
    (a subset); every document with the declared names alone is kept. Returns ``schema``
    itself when nothing changes."""
    text = json.dumps(schema)
    guarded = any(f'"{k}"' in text for k in _CONJUNCTIVE)
    if _names_come_from_elsewhere(schema, guarded and '"$ref"' in text):
        return schema

    def node(n: dict[str, Any], where: str) -> dict[str, Any]:
        props = n.get("properties")
        if not isinstance(props, dict) or not props or _INSIDE.search(where):
            return n
        if guarded and _DEFS.search(where):
            return n
        if any(k in n for k in _OPEN_SIBLINGS):
            return n
        req = n.get("required", [])
        if not isinstance(req, list) or any(r not in props for r in req):
            return n
        if _count(n, "minProperties") > len(props):
            return n
        return {**n, "additionalProperties": False}

    return map_subschemas(schema, node)


_ANNOTATIONS = frozenset(
    {"$ref", "$dynamicRef", "title", "description", "default", "examples", "$comment", "deprecated"}
)
_APPLICATORS = ("anyOf", *_CONJUNCTIVE)


def _names_come_from_elsewhere(schema: Any, ref_under_conjunction: bool) -> bool:
    """Whether an object's allowed names may be declared by another schema that applies to the
    same instance, where closing one of them would refuse the other's names: a ``$ref``
    beside other keywords (target and siblings apply together), a node with ``properties``
    whose applicator branches (``anyOf``, ``allOf``, ...) name ``properties`` too, or a
    reference where ``oneOf`` / ``not`` / ... appear (a target reached from such a branch
    would stop matching). Then nothing is closed."""
    found: list[bool] = []

    def branches(node: dict[str, Any]) -> list[Any]:
        out: list[Any] = []
        for k in _APPLICATORS:
            v = node.get(k)
            out.extend(v if isinstance(v, list) else [v] if isinstance(v, dict) else [])
        if isinstance(node.get("dependentSchemas"), dict):
            out.extend(node["dependentSchemas"].values())
        return out

    def look(node: dict[str, Any], _where: str) -> dict[str, Any]:
        if ("$ref" in node or "$dynamicRef" in node) and set(node) - _ANNOTATIONS:
            found.append(True)
        elif "properties" in node and any(
            isinstance(b, dict) and ("properties" in b or "$ref" in b) for b in branches(node)
        ):
            found.append(True)
        return node

    map_subschemas(schema, look)
    return ref_under_conjunction or bool(found)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def bound_numbers(schema: Any, max_digits: int | None, *, fraction: int | None = None) -> Any:
    """``schema`` with numeric bounds added where a subschema typed ``integer`` / ``number``
    sets none, so that a library that writes bounded numbers as digit ranges (xgrammar,
    llguidance) writes at most ``max_digits`` integer digits: integers get ``minimum`` /
    ``maximum`` ``∓(10**max_digits - 1)``, numbers ``exclusiveMinimum`` / ``exclusiveMaximum``
    ``∓10**max_digits``. A side the user bounds is kept as written (the added bound is the
    other side only), and a bound is not added where the user's other bound lies beyond it
    (the schema would accept nothing). With ``fraction`` (a digit count), number subschemas
    without ``multipleOf`` also get ``multipleOf: 10**-fraction`` (llguidance then writes at
    most that many fraction digits). Returns ``schema`` itself when nothing changes."""
    if max_digits is None:
        return schema
    top = 10**max_digits

    def node(n: dict[str, Any], _where: str) -> dict[str, Any]:
        types = types_of(n)
        if not types & {"integer", "number"} or "const" in n or "enum" in n:
            return n
        integer = "number" not in types
        lo = [x for x in (_num(n.get("minimum")), _num(n.get("exclusiveMinimum"))) if x is not None]
        hi = [x for x in (_num(n.get("maximum")), _num(n.get("exclusiveMaximum"))) if x is not None]
        out = dict(n)
        if not lo and all(h > -top + 1 for h in hi):
            if integer:
                out["minimum"] = -(top - 1)
            else:
                out["exclusiveMinimum"] = -top
        if not hi and all(x < top - 1 for x in lo):
            if integer:
                out["maximum"] = top - 1
            else:
                out["exclusiveMaximum"] = top
        if fraction is not None and not integer and "multipleOf" not in n:
            out["multipleOf"] = float(f"1e-{fraction}")
        return n if out == n else out

    return map_subschemas(schema, node)


def limit_applies(schema: Any, name: str, limits: OutputLimits) -> bool:
    """Whether the output limit ``name`` of ``limits`` reaches anything in ``schema``: a string
    or array it would cap (:func:`cap_lengths`), an object it would close
    (:func:`close_objects`), a number it would bound (:func:`bound_numbers`);
    ``max_whitespace`` always (whitespace may go between any two tokens). A warning that a
    backend does not enforce a limit is said only where it applies."""
    if name == "max_whitespace":
        return True
    if name in ("max_string_length", "max_items"):
        only = OutputLimits(**{name: getattr(limits, name)})
        return cap_lengths(schema, only) is not schema
    if name == "closed_objects":
        return close_objects(schema) is not schema
    if name == "max_digits":
        return bound_numbers(schema, limits.max_digits) is not schema
    return True


_NOT_SUBSCHEMAS = frozenset({"const", "enum", "default", "examples"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_INT64 = 2**63 - 1


def out_of_range_number(schema: Any) -> str | None:
    """``"<keyword> at <pointer>"`` of the first numeric keyword of ``schema`` that the native
    libraries cannot hold, else None: any number past a double's range (xgrammar 0.2.9's JSON
    reader fails with an empty message on ``10**400``) and, on an ``integer`` schema, a bound
    outside ``(-2**63 + 1, 2**63 - 1)`` (xgrammar: a failed native check; llguidance 1.9 clamps
    it to 64 bits and writes ``9223372036854775807`` for ``minimum: 10**40``). Iterative,
    literals not walked."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            types = node.get("type")
            integer = types == "integer" or (isinstance(types, list) and "integer" in types)
            for k in (*_BOUNDS, "multipleOf"):
                v = node.get(k)
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                try:
                    wide = abs(float(v)) == float("inf")
                except OverflowError:
                    wide = True
                if wide or (integer and k in _BOUNDS and not -_INT64 < v < _INT64):
                    return f"{k} at {'/'.join(('', *path)) or '/'}"
            stack.extend((v, (*path, str(k))) for k, v in node.items() if k not in _NOT_SUBSCHEMAS)
        elif isinstance(node, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(node))
    return None


def largest_string_enum(schema: Any) -> tuple[int, str]:
    """``(bytes, where)``: the ``enum`` of ``schema`` whose string values take the most JSON
    text (UTF-8 bytes of each string written as JSON, quotes included; other values count
    nothing) and its JSON pointer; ``(0, "")`` without one. Iterative, one pass over the
    schema (literal values are not walked into)."""
    best, where = 0, ""
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            values = node.get("enum")
            if isinstance(values, list):
                size = sum(
                    len(json.dumps(v, ensure_ascii=False).encode())
                    for v in values
                    if isinstance(v, str)
                )
                if size > best:
                    best, where = size, "/".join(("", *path, "enum"))
            stack.extend((v, (*path, str(k))) for k, v in node.items() if k not in _NOT_SUBSCHEMAS)
        elif isinstance(node, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(node))
    return best, where
