"""Size and nesting estimates of a spec, read before anything is compiled, for the resource
limits of the backends (``docs/reliability.md``, "Bounded resources").

Nesting (``max_nesting_depth``; each measure is a loop over an explicit stack, so a depth of
10**6 costs its length and never Python's recursion limit):

- :func:`json_nesting_depth`: containers (objects and arrays) nested in a JSON document, a
  local ``$ref`` counted one level deeper than its target expanded once (so a chain of
  references counts its length; a reference back into a target being expanded, the
  legitimate recursion of JSON Schema, counts nothing more).
- :func:`group_depth`: groups nested in a regex.
- :func:`grammar_nesting_depth`: brackets nested in the rule bodies of a Lark or GBNF grammar
  (and the groups of its regex terminals).

Regex size (Python's parser, below):

Both walk the pattern as Python's own parser reads it (``re._parser``; the regexes the
backends build from JSON schemas are in the syntax both engines share) without expanding it, so
``a{100000000}`` costs no more to measure than ``a``:

- :func:`regex_positions`: character positions of the pattern with every counted repetition
  unrolled (``X{m,n}`` counts ``n`` copies of ``X``, ``X*`` / ``X{m,}`` counts ``m + 1``); an
  automaton for the pattern has about this many states, and outlines-core's index keeps a
  transition table per state. ``wide`` counts only positions whose character set is large
  (more than :data:`WIDE_SET` characters, e.g. the characters of a JSON string), where a state
  allows most of a vocabulary.
- :func:`regex_forced_bound`: an upper bound on the length (in characters) of any run of text
  the pattern can force from one point: only the minimum copies of a repetition can be forced
  (after them the pattern may stop or go on), plus one copy entered partway.

Each returns None when Python's parser does not read the pattern (engine-specific syntax):
the caller then has no estimate.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .json_pointer import resolve_pointer

try:  # Python >= 3.11
    from re import _constants as _c
    from re import _parser as _p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

__all__ = [
    "regex_positions",
    "regex_forced_bound",
    "regex_repeat_nesting",
    "WIDE_SET",
    "json_nesting_depth",
    "schema_patterns",
    "group_depth",
    "grammar_nesting_depth",
]

WIDE_SET = 64
"""A character set of more than this many characters makes a "wide" position."""

DEFAULT_MAX_GRAMMAR_BYTES = 4_000_000
"""``GrammarBackend``'s default ``max_grammar_bytes``: a spec whose serialized form is larger
is refused before any other check."""

_UNBOUNDED = _c.MAXREPEAT


def _parse(pattern: str) -> Any | None:
    try:
        return _p.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return None


def _set_size(items: Any) -> int:
    """Characters an ``IN`` set holds (negated sets: all but those; categories: many)."""
    n = 0
    negate = False
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            n += 1
        elif op is _c.RANGE:
            n += av[1] - av[0] + 1
        else:  # CATEGORY (\d \w \s and their negations), CHARSET, BIGCHARSET
            n += WIDE_SET + 1
    return 0x110000 - n if negate else n


def _walk(items: Any, wide_only: bool, forced: bool) -> int:
    total = 0
    for op, av in items:
        total += _one(op, av, wide_only, forced)
    return total


def _one(op: Any, av: Any, wide_only: bool, forced: bool) -> int:
    if op in (_c.LITERAL, _c.NOT_LITERAL):
        return 0 if wide_only and op is _c.LITERAL else 1
    if op is _c.ANY:
        return 1
    if op is _c.IN:
        return 1 if not wide_only or _set_size(av) > WIDE_SET else 0
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        lo, hi, body = av
        inner = _walk(body, wide_only, forced)
        copies = lo + 1 if forced or hi == _UNBOUNDED else hi
        return copies * inner
    if op is _c.SUBPATTERN:
        return _walk(av[-1], wide_only, forced)
    if op is _c.BRANCH:
        parts = [_walk(b, wide_only, forced) for b in av[1]]
        return max(parts, default=0) if forced else sum(parts)
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return _walk(av[1], wide_only, forced)
    if op is _c.GROUPREF_EXISTS:
        parts = [_walk(b, wide_only, forced) for b in av[1:] if b is not None]
        return max(parts, default=0) if forced else sum(parts)
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return _walk(av, wide_only, forced)
    return 0  # AT (anchors), GROUPREF: no characters of their own


def _repeat_nesting(items: Any) -> int:
    """Counted repetitions (a finite bound above 1) nested in ``items``, the most along a path."""
    deepest = 0
    for op, av in items:
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
            inner = _repeat_nesting(av[2])
            deepest = max(deepest, inner + (1 < av[1] != _UNBOUNDED))
        elif op is _c.SUBPATTERN:
            deepest = max(deepest, _repeat_nesting(av[-1]))
        elif op is _c.BRANCH:
            deepest = max([deepest] + [_repeat_nesting(b) for b in av[1]])
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            deepest = max(deepest, _repeat_nesting(av[1]))
        elif op is getattr(_c, "ATOMIC_GROUP", None):
            deepest = max(deepest, _repeat_nesting(av))
    return deepest


def regex_repeat_nesting(pattern: str) -> int | None:
    """Counted repetitions (``X{m,n}`` with ``1 < n < inf``) nested inside one another in
    ``pattern``, the most along a path (``((a{0,3}),){0,3}``: 2); None when Python's parser
    does not read the pattern. The regex of nested arrays with ``maxItems`` has one level per
    array."""
    parsed = _parse(pattern)
    try:
        return None if parsed is None else _repeat_nesting(parsed)
    except RecursionError:
        return None


def regex_positions(pattern: str, *, wide_only: bool = False) -> int | None:
    """Character positions of ``pattern`` with counted repetitions unrolled (see the module
    docstring); ``wide_only`` counts only positions with more than :data:`WIDE_SET`
    characters. None when Python's parser does not read the pattern."""
    parsed = _parse(pattern)
    return None if parsed is None else _walk(parsed, wide_only, False)


def regex_forced_bound(pattern: str) -> int | None:
    """Upper bound on the characters ``pattern`` can force in one run (see the module
    docstring); None when Python's parser does not read it."""
    parsed = _parse(pattern)
    return None if parsed is None else _walk(parsed, False, True)


_LITERALS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON values, not schemas: no ``$ref`` or ``pattern`` in them."""


def _children(node: Any, literal: bool) -> Iterator[tuple[Any, bool, str | None]]:
    """``(child, literal, ref)`` for each container inside ``node`` (``ref``: a local
    reference to follow instead of a child, the child then None)."""
    if isinstance(node, dict):
        for key, value in node.items():
            lit = literal or key in _LITERALS
            if key == "$ref" and not lit and isinstance(value, str) and value.startswith("#"):
                yield None, lit, value
            elif isinstance(value, (dict, list)):
                yield value, lit, None
    else:
        for value in node:
            if isinstance(value, (dict, list)):
                yield value, literal, None


def json_nesting_depth(value: Any) -> int:
    """Nesting depth of JSON document ``value`` (0 for a scalar, 1 for ``{}`` or ``[1]``; the
    depth Rust's ``serde_json`` counts, 128 at most by default, and pydantic's serializer),
    with local references of a JSON schema expanded (outside ``const`` / ``enum`` /
    ``default`` / ``examples``): an object with ``"$ref": "#/..."`` is one level deeper than
    its target, so a chain of references (``a0 -> a1 -> ...``, each ``{"$ref": ...}``)
    counts its length, as the libraries' compilers recurse once per reference followed. A
    reference to a node being walked (one enclosing it, or a target being expanded: the
    legitimate recursion of JSON Schema) or one that does not resolve adds nothing, so
    recursive schemas have a finite depth. Iterative, and each container is walked once (its
    depth kept for every later reference to it): O(size of ``value`` + length of its
    references)."""
    if not isinstance(value, (dict, list)):
        return 0
    done: dict[tuple[int, bool], int] = {}  # (id(container), literal) -> its depth
    walking: set[int] = {id(value)}  # the containers on the stack
    # frame: [children, deepest child so far, its key in done]
    stack: list[list[Any]] = [[_children(value, False), 0, (id(value), False)]]
    depth = 0
    while stack:
        frame = stack[-1]
        nxt = next(frame[0], None)
        if nxt is None:
            stack.pop()
            depth = frame[1] + 1
            done[frame[2]] = depth
            walking.discard(frame[2][0])
            if stack:
                stack[-1][1] = max(stack[-1][1], depth)
            continue
        child, literal, ref = nxt
        if ref is not None:  # the target counts as a child of the object holding the $ref
            child, literal = resolve_pointer(value, ref), False
            if not isinstance(child, (dict, list)):
                continue
        if id(child) in walking:
            continue
        key = (id(child), literal)
        if key in done:
            frame[1] = max(frame[1], done[key])
        else:
            walking.add(id(child))
            stack.append([_children(child, literal), 0, key])
    return depth


def schema_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """``(JSON pointer, pattern)`` of every ``pattern`` keyword and ``patternProperties`` name
    of ``schema`` (outside literal values), in document order; iterative (a node's pointer is
    spelled only for a pattern it holds: spelling every one would be quadratic in the
    depth)."""
    # (node, (parent link, key) or None, inside a literal value)
    stack: list[tuple[Any, Any, bool]] = [(schema, None, False)]
    while stack:
        node, link, literal = stack.pop()
        if isinstance(node, dict):
            if not literal:
                if isinstance(node.get("pattern"), str):
                    yield _spelled(link) + "/pattern", node["pattern"]
                if isinstance(node.get("patternProperties"), dict):
                    for name in node["patternProperties"]:
                        yield _spelled(link) + "/patternProperties", str(name)
            items = [(v, (link, k), literal or k in _LITERALS) for k, v in node.items()]
        elif isinstance(node, list):
            items = [(v, (link, i), literal) for i, v in enumerate(node)]
        else:
            continue
        stack.extend(reversed([x for x in items if isinstance(x[0], (dict, list))]))


def _spelled(link: Any) -> str:
    parts = []
    while link is not None:
        link, key = link
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
    return "".join(f"/{p}" for p in reversed(parts))


def group_depth(pattern: str) -> int:
    """Groups nested in regex ``pattern`` (``(a(b))``: 2), read as Python's ``re`` and ECMA
    262 read brackets: an escaped character and a character class hold no group."""
    depth = deepest = i = 0
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            continue
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _class_end(text: str, i: int) -> int:
    """Index after the character class opening at ``text[i]`` (a ``]`` first in the class is
    a literal, as in Python's ``re`` and GBNF)."""
    j = i + 1
    if text[j : j + 1] == "^":
        j += 1
    if text[j : j + 1] == "]":
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


_LARK_NAME = re.compile(r"[A-Za-z_]\w*")
_GBNF_NAME = re.compile(r"[A-Za-z_][\w-]*")


def grammar_nesting_depth(text: str, dialect: str) -> int:
    """Nesting of a grammar's rule bodies, ``dialect`` ``"lark"`` or ``"ebnf"`` (GBNF): brackets
    (Lark: groups ``()``, optionals ``[]``, template arguments ``{}``, and a ``/regex/``
    terminal's :func:`group_depth` where it stands; GBNF: groups ``()``, ``[...]`` being a
    character class), each reference to a rule adding one level and that rule's own depth.
    A reference back into a rule being expanded (recursion) adds nothing, so the depth is
    that of the deepest chain of distinct rules. Strings, comments (``//`` in Lark, ``#`` in
    GBNF) and Lark's ``%`` directives are skipped. Iterative: O(len(text) + references)."""
    rules = _rule_bodies(text, dialect == "lark")
    done: dict[str, int] = {}
    for root in rules:
        if root in done:
            continue
        active = {root}
        # frame: [rule, its references, deepest so far, depth of the reference being expanded]
        stack: list[list[Any]] = [[root, iter(rules[root][1]), rules[root][0], 0]]
        while stack:
            frame = stack[-1]
            nxt = next(frame[1], None)
            if nxt is None:
                stack.pop()
                done[frame[0]] = frame[2]
                active.discard(frame[0])
                if stack:
                    parent = stack[-1]
                    parent[2] = max(parent[2], parent[3] + 1 + frame[2])
                continue
            name, at = nxt
            if name in done:
                frame[2] = max(frame[2], at + 1 + done[name])
            elif name in rules and name not in active:
                frame[3] = at
                active.add(name)
                stack.append([name, iter(rules[name][1]), rules[name][0], 0])
    return max(done.values(), default=0)


def _rule_bodies(text: str, lark: bool) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """Rule name -> (deepest bracket nesting of its body, [(rule referred to, bracket depth
    there)]); text before the first rule goes under ``""``."""
    opens, closes = ("([{", ")]}") if lark else ("(", ")")
    names = _LARK_NAME if lark else _GBNF_NAME
    rules: dict[str, tuple[list[int], list[tuple[str, int]]]] = {"": ([0], [])}
    deepest, refs = rules[""]
    depth = i = 0
    n = len(text)
    line_start = True
    while i < n:
        ch = text[i]
        if ch == "\n":
            line_start, i = True, i + 1
            continue
        if ch in " \t\r" or (lark and line_start and ch in "?!"):
            i += 1
            continue
        starts, line_start = line_start, False
        if ch in "\"'" and (ch == '"' or lark):
            j = i + 1
            while j < n and text[j] != ch and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif (lark and (text.startswith("//", i) or (starts and ch == "%"))) or (
            not lark and ch == "#"
        ):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif lark and ch == "/":
            j = i + 1
            while j < n and text[j] not in "/\n":
                j = _class_end(text, j) if text[j] == "[" else j + (2 if text[j] == "\\" else 1)
            deepest[0] = max(deepest[0], depth + group_depth(text[i + 1 : j]))
            i = j + 1
        elif not lark and ch == "[":
            i = _class_end(text, i)
        elif ch.isalpha() or ch == "_":
            m = names.match(text, i)
            assert m is not None
            after = _definition_end(text, m.end(), lark) if starts else None
            if after is not None:
                deepest, refs = rules.setdefault(m.group(), ([0], []))
                depth, i = 0, after
            else:
                refs.append((m.group(), depth))
                i = m.end()
        else:
            if ch in opens:
                depth += 1
                deepest[0] = max(deepest[0], depth)
            elif ch in closes:
                depth = max(depth - 1, 0)
            i += 1
    return {k: (v[0][0], v[1]) for k, v in rules.items()}


def _definition_end(text: str, j: int, lark: bool) -> int | None:
    """Index after the ``::=`` (GBNF) or ``[.priority] :`` (Lark) that follows a name at the
    start of a line at ``j``, or None when the name is not being defined."""
    if lark and text[j : j + 1] == ".":
        j += 1
        while j < len(text) and text[j].isdigit():
            j += 1
    while j < len(text) and text[j] in " \t":
        j += 1
    op = ":" if lark else "::="
    return j + len(op) if text.startswith(op, j) else None
