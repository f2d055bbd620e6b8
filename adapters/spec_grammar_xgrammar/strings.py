"""Length-bounded JSON strings for xgrammar 0.2.9.

xgrammar writes a string with ``minLength`` / ``maxLength`` (and no ``pattern`` / ``format``)
as ``"\\"" X_characters{m, n} "\\""`` with ``X_characters ::= [^"\\\\\\r\\n]``: every raw
control character but CR and LF is allowed (a tab or U+0000 inside the string: not a JSON
document), and no escape sequence is (``"\\n"`` refused). A ``pattern`` cannot carry the
repair: xgrammar misreads escapes inside a repeated part of a pattern, and a pattern
``[^"\\\\\\x00-\\x1f]{0,100}`` took ~1 s to compile against ~20 ms (measured, SmolLM2
tokenizer). So the converted grammar's text is patched instead: each such character rule
becomes one JSON character, an unescaped non-control character or an escape sequence, so an
escape counts as one character toward the bound as JSON Schema counts it.
"""

from __future__ import annotations

import re

import xgrammar as xgr

__all__ = ["bounded_strings_fixed"]

_BOUNDED_CHARACTERS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
"""A rule of xgrammar's JSON-schema converter for one character of a length-bounded string
(``root_prop_0_characters ::= (([^\\"\\\\\\r\\n]))`` as ``str(Grammar)`` prints it)."""

_ESCAPE_RULE = "spec_grammar_json_escape"
_ESCAPE = rf'{_ESCAPE_RULE} ::= [\"\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]'


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
