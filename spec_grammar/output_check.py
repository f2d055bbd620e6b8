"""The post-check: a completed output checked against its request *as written*.

A grammar backend may leave keywords of a schema unenforced (declared at compile time:
:mod:`spec_grammar.json_schema.strict`), so the text a constrained decode produced is not
trusted to be valid because the grammar accepted it. :func:`check_output` checks it with an
oracle that knows nothing of the grammar engines:

- :class:`~spec_grammar.specs.JsonSchema`: the text parsed as JSON, then ``jsonschema`` on the
  user's schema (``spec.json_schema``: the output limits are our rewrite, written into the
  compiled schema only, so a capped ``maxLength`` is not part of the check). The draft is the
  one ``$schema`` names, Draft 2020-12 otherwise; ``format`` is an annotation (that draft's
  default) and ``$`` in a ``pattern`` matches at the end only, as ECMA 262 reads it
  (:func:`spec_grammar.testing.differential.oracle`, the oracle the conformance suite uses).
- :class:`~spec_grammar.specs.ToolCalls`: the output read back as calls
  (:func:`~spec_grammar.tool_calls.parse_tool_calls`); each call must be ``{"name",
  "arguments"}`` naming a function ``tool_choice`` allows, its arguments valid under that
  function's ``parameters`` (OpenAI's strict reading when the function says ``"strict":
  true``); the number of calls within ``tool_choice`` (``required`` / a name: at least one),
  ``parallel_tool_calls`` (False: at most one) and ``max_tool_calls``.
- :class:`~spec_grammar.specs.Regex`: a full match (``re.fullmatch``: the dialect the adapters
  read patterns in, :mod:`spec_grammar.json_schema.pattern`), the ``regex`` package for a
  pattern Python's ``re`` cannot compile (``\\p{L}`` ...), no oracle when neither can.
- :class:`~spec_grammar.specs.Ebnf` / :class:`~spec_grammar.specs.Lark`: no oracle
  (``valid=None``): the grammar is the only definition of its language.

Paths are JSON pointers (RFC 6901) into the output document; for tool calls they start at the
list of calls (``/0/arguments/city``).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from typing import Any

from pydantic import BaseModel

from .specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, ToolCalls, openai_strict

__all__ = ["Violation", "check_output", "MAX_VIOLATIONS"]

MAX_VIOLATIONS = 20
"""Violations reported per output at most (the first ones, in ``jsonschema``'s order): a
wrong-typed array of 10,000 items would otherwise make a result of 10,000 lines."""


class Violation(BaseModel):
    """One way an output breaks its request: ``path`` a JSON pointer into the output (``""``
    = the whole output), ``message`` what is wrong there, ``keyword`` the schema keyword that
    failed (``jsonschema``'s ``validator``) or a pseudo-keyword of ours (``json`` = the text
    does not parse, ``tool_choice`` / ``parallel_tool_calls`` / ``max_tool_calls`` = the number
    of calls, ``name`` = a function the request does not offer, ``regex`` = no full match)."""

    path: str
    message: str
    keyword: str | None = None


def check_output(spec: GrammarSpec | None, text: str) -> tuple[bool | None, list[Violation]]:
    """``(valid, violations)`` of ``text`` under ``spec`` as written (module docstring):
    ``valid`` is None where no oracle exists (no grammar, EBNF, Lark, a regex no engine here
    compiles), then ``violations`` is empty; otherwise ``valid`` is True exactly when
    ``violations`` is empty. Never raises on any ``text``."""
    if spec is None or isinstance(spec, (Ebnf, Lark)):
        return None, []
    if isinstance(spec, JsonSchema):
        try:
            doc = json.loads(text)
        except ValueError as e:
            return False, [Violation(path="", message=f"not JSON: {e}", keyword="json")]
        except RecursionError:
            return False, [_too_deep("the output")]
        out = _schema_violations(spec.json_schema, doc, "")
        return not out, out
    if isinstance(spec, ToolCalls):
        out = _tool_call_violations(spec, text)
        return not out, out
    if isinstance(spec, Regex):
        # jsonschema's module: loaded when used
        from .json_schema.oracle import PatternTimeout, compiled_pattern, pattern_matches

        try:
            compiled_pattern(spec.pattern)
        except (re.error, RecursionError):  # no engine here compiles it: no oracle
            return None, []
        try:
            if pattern_matches(spec.pattern, text, full=True):
                return True, []
        except PatternTimeout as e:
            return False, [Violation(path="", message=str(e), keyword="oracle")]
        return False, [
            Violation(path="", message=f"does not match {spec.pattern!r} in full", keyword="regex")
        ]
    return None, []


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    """The oracle's validator of a schema (JSON text: the cache key), built once per schema:
    building one resolves the draft and wraps the keywords (~50 us), checking with it is the
    per-output cost."""
    from .json_schema.oracle import oracle

    return oracle(json.loads(schema_json))


def _schema_violations(schema: Any, doc: Any, base: str) -> list[Violation]:
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [Violation(path=base, message="the schema `false` allows nothing", keyword="false")]
    out = []
    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # odd patterns warn in re
            for e in validator.iter_errors(doc):
                where = "".join(f"/{_escape(str(p))}" for p in e.absolute_path)
                out.append(
                    Violation(path=base + where, message=e.message[:300], keyword=str(e.validator))
                )
                if len(out) >= MAX_VIOLATIONS:
                    break
    # the oracle itself failed (a pattern past its timeout, a remote $ref it cannot resolve, a
    # schema too deep for it, a number it cannot hold): say so, never pass the output
    except Exception as e:  # noqa: BLE001
        out.append(
            Violation(path=base, message=f"the schema could not be checked: {e}", keyword="oracle")
        )
    return out


def _tool_call_violations(spec: ToolCalls, text: str) -> list[Violation]:
    from .tool_calls import parse_tool_calls

    try:
        _content, calls = parse_tool_calls(text, spec)
    except ValueError as e:
        return [Violation(path="", message=f"the tool calls do not parse: {e}", keyword="json")]
    except RecursionError:
        return [_too_deep("the tool calls")]
    if spec.call_format == "json_array" and not isinstance(calls, list):
        return [Violation(path="", message="the output is not a list of calls", keyword="type")]
    out: list[Violation] = []
    fns = {f["name"]: f for f in spec.functions()}
    for i, call in enumerate(calls):
        at = f"/{i}"
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            keys = sorted(call) if isinstance(call, dict) else type(call).__name__
            out.append(
                Violation(
                    path=at,
                    message=f'a call is {{"name", "arguments"}}, got {keys}',
                    keyword="call",
                )
            )
            continue
        fn = fns.get(call["name"]) if isinstance(call["name"], str) else None
        if fn is None:
            out.append(
                Violation(
                    path=f"{at}/name",
                    message=f"{call['name']!r} is not a function this request offers "
                    f"({', '.join(fns)})",
                    keyword="name",
                )
            )
            continue
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if fn.get("strict") is True:
            params = openai_strict(params)
        out += _schema_violations(params, call["arguments"], f"{at}/arguments")
    n = len(calls)
    if spec.tool_choice != "auto" and n == 0:
        choice = "required" if spec.tool_choice == "required" else f"{spec.tool_choice!r}"
        out.append(
            Violation(
                path="",
                message=f"tool_choice={choice} asks for a call, got none",
                keyword="tool_choice",
            )
        )
    if not spec.parallel_tool_calls and n > 1:
        out.append(
            Violation(
                path="",
                message=f"parallel_tool_calls=false allows one call, got {n}",
                keyword="parallel_tool_calls",
            )
        )
    if spec.max_tool_calls is not None and n > spec.max_tool_calls:
        out.append(
            Violation(
                path="",
                message=f"max_tool_calls={spec.max_tool_calls}, got {n} calls",
                keyword="max_tool_calls",
            )
        )
    return out[:MAX_VIOLATIONS]


def _too_deep(what: str) -> Violation:
    """The violation of a text nested too deeply for Python's JSON parser: no verdict on it
    can be given, so it is not passed."""
    return Violation(
        path="",
        message=f"{what} nests too deeply to parse (Python's recursion limit)",
        keyword="json",
    )


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
