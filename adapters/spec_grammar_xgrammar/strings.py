"""Length-bounded JSON strings for xgrammar 0.2.9.

xgrammar writes a string with ``minLength`` / ``maxLength`` (and no ``pattern`` / ``format``)
as ``"\\"" X_characters{m, n} "\\""`` with ``X_characters ::= [^"\\\\\\r\\n]``: every raw
control character but CR and LF is allowed (a tab or U+0000 inside the string: not a JSON
document), and no escape sequence is (``"\\n"`` refused). The converted grammar's text is
patched (a ``pattern`` cannot carry the repair: xgrammar misreads escapes inside a repeated
part of a pattern, and a pattern ``[^"\\\\\\x00-\\x1f]{0,100}`` took ~1 s to compile against
~20 ms): each such character rule becomes ``[^"\\\\\\x00-\\x1f]``, so no raw control
character is written and the output is JSON.

Escape sequences stay refused (declared as a refusal of ``minLength`` / ``maxLength``): an
escape is several characters, and any alternative of more than one character inside xgrammar's
bounded repetition makes it check the vocabulary token by token: a mask inside such a string
took 16 ms against 0.011 ms (SmolLM2 tokenizer, ``maxLength: 50``, xgrammar 0.2.9, measured
2026-12-04), which would put every bounded string's rows far behind the forward.
"""

from __future__ import annotations

import re

import xgrammar as xgr

__all__ = ["bounded_strings_fixed"]

_BOUNDED_CHARACTERS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
"""A rule of xgrammar's JSON-schema converter for one character of a length-bounded string
(``root_prop_0_characters ::= (([^\\"\\\\\\r\\n]))`` as ``str(Grammar)`` prints it)."""


def bounded_strings_fixed(grammar: xgr.Grammar) -> xgr.Grammar | None:
    """``grammar`` (from ``Grammar.from_json_schema``) with every length-bounded string's
    character rule replaced by ``[^"\\\\\\x00-\\x1f]``; None when it has no such rule (the
    grammar is right as it is). Costs one print and parse of the grammar text (~3 ms on a
    three-property schema)."""
    text = str(grammar)
    if not _BOUNDED_CHARACTERS.search(text):
        return None
    fixed = _BOUNDED_CHARACTERS.sub(lambda m: rf"{m.group(1)} ::= [^\"\\\0-\x1f]", text)
    return xgr.Grammar.from_ebnf(fixed, root_rule_name="root")
