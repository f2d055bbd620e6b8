"""Size estimates of a regex, read before anything is compiled, for the resource limits of
the backends (``docs/reliability.md``, "Bounded resources").

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
from typing import Any

try:  # Python >= 3.11
    from re import _constants as _c
    from re import _parser as _p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

__all__ = ["regex_positions", "regex_forced_bound", "WIDE_SET"]

WIDE_SET = 64
"""A character set of more than this many characters makes a "wide" position."""

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
