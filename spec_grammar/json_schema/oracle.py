"""The oracle every JSON-Schema check here is measured against: ``jsonschema``'s validator of a
schema, read as JSON Schema's own dialect wants (the conformance suite, the differential tests
and the post-check of outputs, :mod:`spec_grammar.output_check`, all use it)."""

from __future__ import annotations

import functools
import re
from decimal import Decimal, localcontext
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError
from jsonschema.validators import validator_for

__all__ = [
    "oracle",
    "ecma_end",
    "compiled_pattern",
    "pattern_matches",
    "PatternTimeout",
    "PATTERN_TIMEOUT_S",
]


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


PATTERN_TIMEOUT_S = 1.0
"""Seconds one ``pattern`` search may take (the ``regex`` package's ``timeout``): a pattern
that backtracks exponentially (``^(\\w+\\s?)+$`` on 35 letters) would otherwise hold the
check, and the process, for hours."""


class PatternTimeout(Exception):
    """A ``pattern`` search ran past :data:`PATTERN_TIMEOUT_S`: no verdict."""


@functools.lru_cache(maxsize=1024)
def compiled_pattern(pattern: str) -> Any:
    """``pattern`` compiled by the ``regex`` package where it is installed (it reads
    ``\\p{L}`` and other syntax ``re`` lacks, and its searches take a timeout), else by
    ``re``. Raises ``re.error`` for a pattern neither compiles."""
    try:
        import regex
    except ImportError:
        return re.compile(pattern)
    try:
        return regex.compile(pattern)
    except regex.error:
        return re.compile(pattern)  # raises re.error: jsonschema reports the bad pattern


def pattern_matches(pattern: str, text: str, *, full: bool = False) -> bool:
    """``pattern`` found in ``text`` (``full``: matching all of it), searched for at most
    :data:`PATTERN_TIMEOUT_S` where the ``regex`` package runs it; raises
    :class:`PatternTimeout` past that, ``re.error`` for a pattern that does not compile."""
    compiled = compiled_pattern(pattern)
    find = compiled.fullmatch if full else compiled.search
    if isinstance(compiled, re.Pattern):
        return find(text) is not None
    try:
        return find(text, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError as e:
        raise PatternTimeout(
            f"pattern {pattern!r} took over {PATTERN_TIMEOUT_S} s on a string of {len(text)} "
            "characters (catastrophic backtracking)"
        ) from e


def _is_multiple(value: float | int, step: float | int) -> bool:
    """``value`` is an integer multiple of ``step`` in decimal arithmetic on the numbers as
    JSON writes them (``0.3`` is a multiple of ``0.1``; binary floats say it is not), exact at
    any magnitude (``1e308`` against ``0.123456789``: no overflow)."""
    v, s = Decimal(repr(value)), Decimal(repr(step))
    with localcontext() as ctx:
        ctx.prec = max(28, v.adjusted() - s.adjusted() + len(s.as_tuple().digits) + 10)
        return v % s == 0


def _ecma_keywords(cls: Any) -> Any:
    """``cls`` with ``pattern`` / ``patternProperties`` reading ``$`` as ECMA 262 does,
    ``pattern`` searched with a timeout (:class:`PatternTimeout`) and ``multipleOf`` in decimal
    arithmetic (:func:`_is_multiple`)."""
    base = cls.VALIDATORS

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not pattern_matches(ecma_end(patrn), instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, pp, instance, schema):
        yield from base["patternProperties"](
            validator, {ecma_end(k): v for k, v in pp.items()}, instance, schema
        )

    def multiple_of(validator, step, instance, schema):
        if validator.is_type(instance, "number") and not _is_multiple(instance, step):
            yield ValidationError(f"{instance!r} is not a multiple of {step}")

    return jsonschema.validators.extend(
        cls,
        {"pattern": pattern, "patternProperties": pattern_properties, "multipleOf": multiple_of},
    )


_ORACLES: dict[Any, Any] = {}


def oracle(schema: Any) -> jsonschema.protocols.Validator:
    """The ``jsonschema`` validator of ``schema``: the draft its ``$schema`` names, Draft
    2020-12 otherwise; ``format`` is an annotation (the Draft 2020-12 default); ``$`` in a
    pattern matches at the end only (:func:`ecma_end`); a ``pattern`` search past
    :data:`PATTERN_TIMEOUT_S` raises :class:`PatternTimeout`; ``multipleOf`` is decimal."""
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    if cls not in _ORACLES:
        _ORACLES[cls] = _ecma_keywords(cls)
    return _ORACLES[cls](schema)
