"""Length-bounded JSON strings for xgrammar 0.2.9.

xgrammar writes a string with ``minLength`` / ``maxLength`` (and no ``pattern`` / ``format``)
as ``"\\"" X_characters{m, n} "\\""`` with ``X_characters ::= [^"\\\\\\r\\n]``: every raw
control character but CR and LF is allowed (a tab or U+0000 inside the string: not a JSON
document), and no escape sequence is (``"\\n"`` refused). A ``pattern`` cannot carry the
repair: xgrammar misreads escapes inside a repeated part of a pattern, and a pattern
``[^"\\\\\\x00-\\x1f]{0,100}`` took ~1 s to compile against ~20 ms (measured, SmolLM2
tokenizer). So the converted grammar's text is patched instead: each such character rule
becomes one JSON character, an unescaped non-control character or an escape sequence, so an
escape counts as one character toward the bound as JSON Schema counts it (a surrogate pair of
escapes: one; a lone surrogate escape, which is no Unicode text, is refused).
"""

from __future__ import annotations

import re

import xgrammar as xgr

__all__ = ["bounded_strings_fixed"]

_BOUNDED_CHARACTERS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
"""A rule of xgrammar's JSON-schema converter for one character of a length-bounded string
(``root_prop_0_characters ::= (([^\\"\\\\\\r\\n]))`` as ``str(Grammar)`` prints it)."""

_ESCAPE_RULE = "spec_grammar_json_escape"
_H = "[0-9A-Fa-f]"
# one character: a short escape, a \\u escape outside the surrogates, or a surrogate pair
# (two escapes, one code point, as json.loads and jsonschema count it); a lone surrogate is
# refused, since a high one followed by a low one would otherwise count twice
_ESCAPE = (
    rf'{_ESCAPE_RULE} ::= [\"\\/bfnrt] | "u" [0-9A-Ca-cE-Fe-f] {_H} {_H} {_H} '
    rf'| "u" [Dd] [0-7] {_H} {_H} | "u" [Dd] [89ABab] {_H} {_H} "\\u" [Dd] [C-Fc-f] {_H} {_H}'
)


def bounded_strings_fixed(grammar: xgr.Grammar) -> xgr.Grammar | None:
    """``grammar`` (from ``Grammar.from_json_schema``) with every length-bounded string's
    character rule replaced by one JSON string character (``[^"\\\\\\x00-\\x1f]`` or ``"\\\\"``
    and an escape); None when it has no such rule (the grammar is right as it is). Costs one
    print and parse of the grammar text (~3 ms on a three-property schema)."""
    text = str(grammar)
    if not _BOUNDED_CHARACTERS.search(text):
        return None
    fixed = _BOUNDED_CHARACTERS.sub(
        lambda m: rf'{m.group(1)} ::= [^\"\\\0-\x1f] | "\\" {_ESCAPE_RULE}', text
    )
    return xgr.Grammar.from_ebnf(fixed + "\n" + _ESCAPE + "\n", root_rule_name="root")
