r"""JSON-Schema ``pattern`` regexes rewritten into a form grammar libraries cannot misread.

A schema ``pattern`` is a *search* (``jsonschema`` runs ``re.search(pattern, value)``: the
pattern may match anywhere unless anchored) over the *decoded* string value, with Python's
``re`` character classes (``\d``, ``\w``, ``\s`` and ``.`` are Unicode-wide). The libraries
read it otherwise: xgrammar 0.2.9 and outlines-core 0.2.14 match the pattern in full against
the string's raw JSON text (so ``"a\"c"`` passed ``^a\\"c$``, a pattern ``abc`` refused
``xxabcyy``, and outlines' ``[^a]`` let a bare ``"`` end the string early), xgrammar ignores a
look-ahead and anchors inside an alternation with a log line only, and llguidance reads
``\w`` / ``\d`` / ``\s`` as ASCII classes.

:func:`translate` parses the pattern with Python's own parser (``re._parser``, the one
``jsonschema``'s ``re.search`` uses, so the oracle and the rewrite agree on the syntax) and
writes a regex that matches exactly the strings the search accepts, *in full*, in a portable
subset every library reads the same way: explicit character sets (class escapes, ``.`` and
negated sets expanded from Python's own definitions: ``str.isdecimal``, ``str.isalnum`` or
``_``, ``str.isspace``, as ``_sre`` defines them), non-capturing groups, alternation and
``{m,n}`` repeats; no anchors, no flags. Two targets:

- ``"value"``: a regex over the decoded value (llguidance, which applies patterns to the value);
- ``"json"``: a regex over the string's JSON text between the quotes (xgrammar, outlines, which
  match the raw text): each character becomes the alternation of its JSON spellings: itself
  when JSON allows it raw, its short escape (``\"``, ``\\``, ``\/``, ``\b`` ...), ``\u00XX``
  (either case of hex) for the other control characters. Printable characters are not also
  accepted as ``\uXXXX`` (a spelling restriction only: every value can still be written).

One deliberate difference from Python's ``re``: ``$`` matches at the end of the string only, as
ECMA 262 (the dialect JSON Schema names for ``pattern``) has it, not also before a final
newline (a Python-ism; :func:`spec_grammar.testing.differential.oracle` reads ``$`` the same
way).

Features with no regular equivalent that this module writes (look-around, backreferences,
word boundaries, anchors inside a group or mid-sequence, conditionals, atomic groups,
case-insensitive or other flags except ``(?s)``) raise :class:`UnsupportedPattern`: the
adapter then leaves the pattern out and declares it (``pattern`` warning; strict mode refuses).
"""

from __future__ import annotations

import sys
from functools import cache

if sys.version_info >= (3, 11):
    from re import _constants as C
    from re import _parser as P
else:  # pragma: no cover - Python 3.10
    import sre_constants as C
    import sre_parse as P

__all__ = ["UnsupportedPattern", "translate", "translate_ex", "Ranges", "NOTHING"]

MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)

Ranges = tuple[tuple[int, int], ...]
"""A set of code points as sorted, disjoint, non-adjacent inclusive ranges."""


class UnsupportedPattern(ValueError):
    """The pattern uses a feature :func:`translate` cannot express; ``feature`` names it."""

    def __init__(self, feature: str, pattern: str):
        super().__init__(f"{feature} in pattern {pattern!r}")
        self.feature = feature


# -- code-point sets --------------------------------------------------------------------------


def _norm(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _minus(a: Ranges, b: Ranges) -> Ranges:
    out = []
    for lo, hi in a:
        cur = lo
        for blo, bhi in b:
            if bhi < cur or blo > hi:
                continue
            if blo > cur:
                out.append((cur, blo - 1))
            cur = max(cur, bhi + 1)
        if cur <= hi:
            out.append((cur, hi))
    return _norm(out)


NOTHING = "[^\\u0000-" + chr(MAX_CODE_POINT) + "]"
"""A regex no string matches (a character outside every code point)."""

ALL: Ranges = _minus(((0, MAX_CODE_POINT),), (_SURROGATES,))
"""Every Unicode scalar value (JSON strings hold no lone surrogates)."""


def _complement(a: Ranges) -> Ranges:
    return _minus(ALL, a)


@cache
def _category(name: str) -> Ranges:
    """Python ``re``'s class escapes on ``str`` patterns, as ``_sre`` defines them."""
    test = {
        "digit": str.isdecimal,
        "word": lambda ch: ch.isalnum() or ch == "_",
        "space": str.isspace,
    }[name]
    out, start = [], None
    for cp in range(MAX_CODE_POINT + 2):
        inside = (
            cp <= MAX_CODE_POINT and not (_SURROGATES[0] <= cp <= _SURROGATES[1]) and test(chr(cp))
        )
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append((start, cp - 1))
            start = None
    return _norm(out)


_CATEGORIES = {
    C.CATEGORY_DIGIT: ("digit", False),
    C.CATEGORY_NOT_DIGIT: ("digit", True),
    C.CATEGORY_WORD: ("word", False),
    C.CATEGORY_NOT_WORD: ("word", True),
    C.CATEGORY_SPACE: ("space", False),
    C.CATEGORY_NOT_SPACE: ("space", True),
}


def _class_set(items: list, pattern: str) -> Ranges:
    negate = False
    out: list[tuple[int, int]] = []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            out.append((av, av))
        elif op is C.RANGE:
            out.append((av[0], av[1]))
        elif op is C.CATEGORY:
            name, neg = _CATEGORIES.get(av, (None, False))
            if name is None:
                raise UnsupportedPattern(f"class {av}", pattern)
            cat = _category(name)
            out.extend(_complement(cat) if neg else cat)
        else:
            raise UnsupportedPattern(f"class item {op}", pattern)
    s = _minus(_norm(out), (_SURROGATES,))
    return _complement(s) if negate else s


# -- writing ----------------------------------------------------------------------------------

_BS = "\\u005c"  # one backslash of JSON text (xgrammar 0.2.9 misreads `\\\\` before `n`)
_SHORT_ESCAPES = {
    0x22: _BS + '"',
    0x5C: _BS + _BS,
    0x2F: _BS + "/",
    0x08: _BS + "b",
    0x0C: _BS + "f",
    0x0A: _BS + "n",
    0x0D: _BS + "r",
    0x09: _BS + "t",
}
"""Code point -> regex of its JSON short escape (``/`` may also be written raw)."""


def _char(cp: int) -> str:
    """``cp`` as a regex atom usable inside and outside a class, in every library's syntax."""
    ch = chr(cp)
    if ch.isascii():
        # \uNNNN: exactly four digits everywhere (xgrammar 0.2.9 reads `\x5fa` as 0x5FA)
        return ch if ch.isalnum() else f"\\u{cp:04x}"
    return ch  # non-ASCII characters are never regex syntax


def _class(ranges: Ranges) -> str:
    if not ranges:
        raise ValueError("empty set")
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    parts = []
    for lo, hi in ranges:
        if lo == hi:
            parts.append(_char(lo))
        elif hi == lo + 1:
            parts.append(_char(lo) + _char(hi))
        else:
            parts.append(f"{_char(lo)}-{_char(hi)}")
    return "[" + "".join(parts) + "]"


def _hex_digit(d: int) -> str:
    h = f"{d:x}"
    return h if h.isdigit() else f"[{h}{h.upper()}]"


class _Writer:
    def __init__(self, pattern: str, target: str, escapes: bool = True, exclude: Ranges = ()):
        if target not in ("value", "json"):
            raise ValueError(f"target must be 'value' or 'json', got {target!r}")
        self.pattern = pattern
        self.json = target == "json"
        self.escapes = escapes
        self.exclude = _norm(list(exclude))
        self.dotall = False
        self.dropped = False  # a character that needs an escape was left out (escapes=False)

    def unit(self, s: Ranges) -> str | None:
        """A regex for one character of ``s`` (None: the empty set, nothing matches)."""
        if self.exclude:
            kept = _minus(s, self.exclude)
            self.dropped = self.dropped or kept != s
            s = kept
        if not s:
            return None
        if not self.json:
            return _class(s)
        raw = _minus(s, ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)))
        if not self.escapes:
            self.dropped = self.dropped or raw != s
            return _class(raw) if raw else None
        alts = [_class(raw)] if raw else []
        for lo, hi in s:
            if lo > 0x5C:
                break
            for cp in range(lo, min(hi, 0x5C) + 1):
                if cp in _SHORT_ESCAPES:
                    alts.append(_SHORT_ESCAPES[cp])
                elif cp < 0x20:
                    alts.append(_BS + "u00" + _hex_digit(cp >> 4) + _hex_digit(cp & 15))
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    def any_char(self) -> Ranges:
        return ALL if self.dotall else _minus(ALL, ((0x0A, 0x0A),))

    def seq(self, items: list) -> str | None:
        out = []
        for op, av in items:
            piece = self.item(op, av)
            if piece is None:
                return None
            out.append(piece)
        return "".join(out)

    def item(self, op, av) -> str | None:
        p = self.pattern
        if op is C.LITERAL:
            return self.unit(((av, av),)) if not (_SURROGATES[0] <= av <= _SURROGATES[1]) else None
        if op is C.NOT_LITERAL:
            return self.unit(_minus(ALL, ((av, av),)))
        if op is C.ANY:
            return self.unit(self.any_char())
        if op is C.IN:
            return self.unit(_class_set(av, p))
        if op is C.BRANCH:
            alts = [a for a in (self.seq(list(b)) for b in av[1]) if a is not None]
            return "(?:" + "|".join(alts) + ")" if alts else None
        if op is C.SUBPATTERN:
            _group, add, delete, sub = av
            if (add or 0) & ~C.SRE_FLAG_DOTALL or (delete or 0):
                raise UnsupportedPattern("inline flags other than (?s)", p)
            saved = self.dotall
            self.dotall = saved or bool((add or 0) & C.SRE_FLAG_DOTALL)
            try:
                inner = self.seq(list(sub))
            finally:
                self.dotall = saved
            return None if inner is None else f"(?:{inner})"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT) or op is getattr(C, "POSSESSIVE_REPEAT", None):
            if op is not C.MAX_REPEAT and op is not C.MIN_REPEAT:
                raise UnsupportedPattern("possessive repeat", p)
            lo, hi, sub = av
            inner = self.seq(list(sub))
            if inner is None:
                return "" if lo == 0 else None
            hi_s = "" if hi == C.MAXREPEAT else str(hi)
            if (lo, hi_s) == (0, ""):
                q = "*"
            elif (lo, hi_s) == (1, ""):
                q = "+"
            elif (lo, hi_s) == (0, "1"):
                q = "?"
            elif hi_s == str(lo):
                q = f"{{{lo}}}"
            else:
                q = f"{{{lo},{hi_s}}}"
            return f"(?:{inner}){q}"
        if op is C.AT:
            raise UnsupportedPattern(f"anchor {av} inside the pattern", p)
        names = {
            C.ASSERT: "look-ahead/look-behind",
            C.ASSERT_NOT: "negative look-around",
            C.GROUPREF: "backreference",
            C.GROUPREF_EXISTS: "conditional group",
        }
        if getattr(C, "ATOMIC_GROUP", None) is op:
            raise UnsupportedPattern("atomic group", p)
        raise UnsupportedPattern(names.get(op, f"regex construct {op}"), p)


_START = (C.AT_BEGINNING, C.AT_BEGINNING_STRING)
_END = (C.AT_END, C.AT_END_STRING)
_MAX_ALTERNATIVES = 64


def _has_anchor(items: list) -> bool:
    for op, av in items:
        if op is C.AT:
            return True
        if op is C.BRANCH and any(_has_anchor(list(b)) for b in av[1]):
            return True
        if op is C.SUBPATTERN and _has_anchor(list(av[3])):
            return True
    return False


def _choices(op, av) -> list[list] | None:
    """The alternatives of a group or alternation item, as sequences (None: not one)."""
    if op is C.BRANCH:
        return [list(b) for b in av[1]]
    if op is C.SUBPATTERN and not av[1] and not av[2]:
        return [list(av[3])]
    return None


def _alternatives(items: list, pattern: str) -> list[tuple[bool, list, str | None]]:
    """The pattern as top-level alternatives ``(anchored_start, body, end)``, ``end`` None
    (unanchored), ``"$"`` or ``"\\Z"``: a leading or trailing group or alternation holding
    anchors is distributed over the sequence (``(^a|b)c`` -> ``^ac``, ``bc``), as the parser
    factors common anchors out of alternatives (``^ab$|^cd$`` parses as ``^(?:ab$|cd$)``).
    Anchors anywhere else raise :class:`UnsupportedPattern`."""
    out: list[tuple[bool, list, str | None]] = []
    todo = [(False, items, None)]
    while todo:
        if len(out) + len(todo) > _MAX_ALTERNATIVES:
            raise UnsupportedPattern("anchors in too many alternatives", pattern)
        start, items, end = todo.pop()
        while items and items[0][0] is C.AT and items[0][1] in _START:
            start, items = True, items[1:]
        while items and items[-1][0] is C.AT and items[-1][1] in _END:
            end = "\\Z" if end == "\\Z" or items[-1][1] is C.AT_END_STRING else "$"
            items = items[:-1]
        if items and _has_anchor(items[:1]) and _choices(*items[0]) is not None:
            for alt in _choices(*items[0]):
                todo.append((start, alt + items[1:], end))
            continue
        if len(items) > 1 and _has_anchor(items[-1:]) and _choices(*items[-1]) is not None:
            for alt in _choices(*items[-1]):
                todo.append((start, items[:-1] + alt, end))
            continue
        if _has_anchor(items):
            raise UnsupportedPattern("an anchor inside the pattern", pattern)
        out.append((start, items, end))
    return out[::-1]


def translate(pattern: str, target: str = "value") -> str | None:
    """A regex matching, in full, exactly the strings ``s`` with ``re.search(pattern, s)``
    (``target="value"``), or their JSON spellings between the quotes (``target="json"``);
    None when no string matches. Raises :class:`UnsupportedPattern` (naming the feature) for
    what the module docstring lists and ``re.error`` for an invalid pattern."""
    return translate_ex(pattern, target)[0]


def translate_ex(
    pattern: str, target: str = "value", escapes: bool = True, exclude: Ranges = ()
) -> tuple[str | None, bool]:
    """:func:`translate`, with ``escapes=False`` (``target="json"`` only) writing no escape
    sequence: the characters JSON must escape (``"``, ``\\``, U+0000..U+001F) are left out of
    every set; the code points of ``exclude`` are left out of every set too. Returns
    ``(regex, dropped)``, ``dropped`` True when such a character was left out (the regex then
    refuses some strings the pattern accepts)."""
    parsed = P.parse(pattern, 0)
    flags = parsed.state.flags & ~(C.SRE_FLAG_UNICODE | C.SRE_FLAG_DOTALL)
    if flags:
        raise UnsupportedPattern("inline flags other than (?s)", pattern)
    w = _Writer(pattern, target, escapes, exclude)
    w.dotall = bool(parsed.state.flags & C.SRE_FLAG_DOTALL)
    anything = f"(?:{w.unit(ALL)})*"
    anything_drops, w.dropped = w.dropped, False  # counted only where an end is unanchored
    alts = []
    for start, body, end in _alternatives(list(parsed), pattern):
        inner = w.seq(body)
        if inner is None:
            continue
        pre = "" if start else anything
        w.dropped = w.dropped or (anything_drops and (not start or end is None))
        if end is None:
            post = anything
        else:  # `$` as ECMA 262 reads it: the end of the string (see the module docstring)
            post = ""
        alts.append(pre + inner + post)
    if not alts:
        return None, w.dropped
    return (
        alts[0] if len(alts) == 1 else "(?:" + "|".join(f"(?:{a})" for a in alts) + ")"
    ), w.dropped
