"""The nesting limit of a spec (``max_nesting_depth`` of every backend), checked before any
library call: deep inputs overflow recursive code (the libraries' parsers and converters, the
meta-schema check, the rewrites of :mod:`spec_grammar.json_schema`), which raises untyped
errors or, in native code, aborts the process. The measures are
:mod:`spec_grammar.limits`' (iterative, so a depth of 10**6 costs its length)."""

from __future__ import annotations

import sys
import threading
from typing import Any

from .errors import GrammarLimitError
from .limits import grammar_nesting_depth, group_depth, json_nesting_depth, schema_patterns
from .specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, ToolCalls

__all__ = [
    "DEFAULT_MAX_NESTING_DEPTH",
    "nesting_depth",
    "check_nesting",
    "too_deep",
    "recursion_room",
]

DEFAULT_MAX_NESTING_DEPTH = 128
"""Default of ``max_nesting_depth``: Rust's ``serde_json`` (llguidance, outlines-core) refuses
JSON nested deeper than 128, pydantic's serializer stops near 255; the deepest schema of the
bundled real corpora is 12."""

FRAMES_PER_LEVEL = 12
"""Python frames one level of a schema costs the recursive steps of a compile: ``jsonschema``'s
meta-schema check takes 8 per level of nested arrays (so Python's default limit of 1,000
refused a schema of depth 127, under ``max_nesting_depth=128``)."""

RECURSION_CEILING = 4_000
"""The most :func:`recursion_room` sets Python's recursion limit to: the C stack of a thread
(8 MiB) holds that many frames of the generator-based walks with room to spare; a spec
deeper than it allows ends in a typed error (:func:`too_deep`), never a crash."""

_room_lock = threading.Lock()

_CALL_WRAP = 3
"""Levels :meth:`ToolCalls.to_json_schema` puts around a function's parameters (the array,
its ``items``' call object, that object's ``properties``)."""


def _schema_parts(schema: Any, extra: int, where: str) -> list[tuple[int, str]]:
    parts = [(json_nesting_depth(schema) + extra, where)]
    parts += [(group_depth(p), f"the pattern at {w or '/'}") for w, p in schema_patterns(schema)]
    return parts


def nesting_depth(spec: GrammarSpec) -> tuple[int, str]:
    """``(depth, what)``: the deepest nesting of ``spec`` and the part it is in. JSON schemas:
    :func:`~spec_grammar.limits.json_nesting_depth` of the schema (tool calls: of each
    function's parameters, plus the levels the call schema wraps them in) and
    :func:`~spec_grammar.limits.group_depth` of each ``pattern``; regexes: group depth; Lark
    and GBNF: :func:`~spec_grammar.limits.grammar_nesting_depth`. Other spec kinds: the JSON
    depth of their fields."""
    if isinstance(spec, JsonSchema):
        parts = _schema_parts(spec.json_schema, 0, "the schema")
    elif isinstance(spec, ToolCalls):
        parts = []
        for i, tool in enumerate(spec.tools):
            params = tool.get("function", tool).get("parameters", {})
            parts += _schema_parts(params, _CALL_WRAP, f"the parameters of tools[{i}]")
    elif isinstance(spec, Regex):
        parts = [(group_depth(spec.pattern), "the regex's groups")]
    elif isinstance(spec, Lark):
        parts = [(grammar_nesting_depth(spec.text, "lark"), "the Lark grammar's rule bodies")]
    elif isinstance(spec, Ebnf):
        parts = [(grammar_nesting_depth(spec.text, "ebnf"), "the GBNF grammar's rule bodies")]
    else:
        parts = [(json_nesting_depth(dict(spec)), f"the {spec.kind} spec")]
    return max(parts, key=lambda p: p[0], default=(0, "the spec"))


def recursion_room(depth: int) -> None:
    """Raise Python's recursion limit (never lower it) so that the recursive steps of a
    compile (the meta-schema check, the schema rewrites, ``pickle`` to a compile process)
    take a spec of nesting ``depth``: 1,000 + :data:`FRAMES_PER_LEVEL` per level, at most
    :data:`RECURSION_CEILING`. The limit is the process's: it only ever grows, to the
    deepest ``max_nesting_depth`` in use (the default, 128: 2,536)."""
    want = min(1_000 + FRAMES_PER_LEVEL * depth, RECURSION_CEILING)
    with _room_lock:
        if sys.getrecursionlimit() < want:
            sys.setrecursionlimit(want)


def check_nesting(
    spec: GrammarSpec, max_depth: int, backend: str | None = None, native_max: int | None = None
) -> None:
    """Raise :class:`GrammarLimitError` when :func:`nesting_depth` of ``spec`` is over
    ``max_depth``, or over ``native_max`` (the deepest nesting the backend's library survives,
    :attr:`GrammarBackend.native_max_nesting_depth
    <spec_grammar.protocol.GrammarBackend.native_max_nesting_depth>`: past it the library
    overflows its native stack and the process dies, so raising ``max_depth`` does not lift
    it). The message names the part, the depth, the limit and how to raise it."""
    depth, where = nesting_depth(spec)
    if depth > max_depth:
        raise GrammarLimitError(
            f"{spec.kind}: nesting depth {depth} ({where}) is over max_nesting_depth="
            f"{max_depth}: flatten the spec, or pass max_nesting_depth= to the backend",
            backend=backend,
            reason=f"nesting depth {depth} > max_nesting_depth {max_depth}",
        )
    if native_max is not None and depth > native_max:
        raise GrammarLimitError(
            f"{spec.kind}: nesting depth {depth} ({where}) is over {native_max}, the deepest "
            f"this backend's library survives (deeper chains of references overflow its native "
            "stack and abort the process; max_nesting_depth does not lift it): flatten the "
            "spec, or use another backend",
            backend=backend,
            reason=f"nesting depth {depth} > the library's safe depth {native_max}",
        )


def too_deep(spec: GrammarSpec, step: str, max_depth: int, backend: str | None = None):
    """The :class:`GrammarLimitError` for a spec within ``max_depth`` that still nests too
    deeply for ``step`` (a recursive parser or rewrite hit Python's recursion limit, a
    serializer its own depth limit): returned, for the caller to raise ``from`` the cause."""
    depth, where = nesting_depth(spec)
    return GrammarLimitError(
        f"{spec.kind}: nesting depth {depth} ({where}) is too deep for {step} (allowed by "
        f"max_nesting_depth={max_depth}): flatten the spec, or lower max_nesting_depth= to "
        "refuse such specs up front",
        backend=backend,
        reason=f"nesting depth {depth}: {step} failed",
    )
