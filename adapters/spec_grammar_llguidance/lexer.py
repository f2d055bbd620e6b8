"""A compile-time check for where llguidance's lexer refuses valid Lark text.

llguidance 1.9.1 lexes greedily: where a literal L1 and a longer literal L2 = L1 + R can both
come next, it takes L2 as soon as the text spells it and does not go back, so text in which L1
is followed by a terminal starting with R is refused. Measured: ``start: "a" "bc" | "ab" "d"``
refuses ``abc``, ``start: ("a" | "aa") "ab"`` refuses ``aab``, ``A: "a" | "ab"`` then ``"bc"``
refuses ``abc`` (xgrammar accepts all three). :func:`greedy_lexer_conflicts` finds such pairs
from the literals alone, without the parser's follow sets: it may name a pair that never meets
at one position (a warning where llguidance is right), never misses one made of literals.
"""

from __future__ import annotations

import ast
import re

__all__ = ["greedy_lexer_conflicts"]

_TOKENS = re.compile(
    r'(?P<comment>//[^\n]*)|(?P<string>"(?:[^"\\\n]|\\.)*"i?)|(?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)'
)


def _literals(text: str) -> tuple[set[str], list[str]]:
    """The grammar's string literals (decoded) and its regex terminals (their sources)."""
    strings: set[str] = set()
    regexes: list[str] = []
    for m in _TOKENS.finditer(text):
        if m.group("string"):
            raw = m.group("string").removesuffix("i")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw[1:-1]
            if isinstance(value, str) and value:
                strings.add(value)
        elif m.group("regex"):
            regexes.append(m.group("regex"))
    return strings, regexes


def _regex_may_start_with(source: str, ch: str) -> bool:
    """Whether the regex terminal ``/.../flags`` may match a string starting with ``ch``: a
    partial match of ``ch`` (the ``regex`` package, a dependency of transformers); True where
    that cannot be told (a warning too many rather than a fault missed)."""
    body, _, flags = source[1:].rpartition("/")
    try:
        import regex

        pattern = regex.compile(body, regex.IGNORECASE if "i" in flags else 0)
    except Exception:  # no `regex` package, or a pattern it does not read
        return True
    return pattern.fullmatch(ch, partial=True) is not None


def greedy_lexer_conflicts(text: str, limit: int = 5) -> list[str]:
    """Up to ``limit`` descriptions of literal pairs where llguidance's greedy lexer may refuse
    valid text: ``"a" is a prefix of "ab" and "bc" starts with the rest "b"``. Costs one regex
    pass over the grammar and a look at each pair of literals (a few ms for hundreds of
    literals)."""
    strings, regexes = _literals(text)
    firsts: dict[str, list[str]] = {}
    for s in sorted(strings):
        firsts.setdefault(s[0], []).append(s)
    out: list[str] = []
    ordered = sorted(strings, key=lambda s: (len(s), s))
    for i, short in enumerate(ordered):
        for long in ordered[i + 1 :]:
            if len(long) == len(short) or not long.startswith(short):
                continue
            rest = long[len(short) :]
            follower = next((s for s in firsts.get(rest[0], ()) if s != long), None)
            if follower is not None:
                out.append(
                    f"{short!r} is a prefix of {long!r} and {follower!r} starts like the rest "
                    f"{rest!r}"
                )
            elif any(_regex_may_start_with(r, rest[0]) for r in regexes):
                out.append(
                    f"{short!r} is a prefix of {long!r} and a regex terminal may start with the "
                    f"rest {rest!r}"
                )
            if len(out) == limit:
                return out
    return out
