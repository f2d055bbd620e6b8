"""Local references of JSON schemas (``"$ref": "#/$defs/a~1b"``) resolved in one place: the
nesting measure (:mod:`spec_grammar.limits`), the finite-document check
(:mod:`spec_grammar.json_schema.check`) and the differential tests
(:mod:`spec_grammar.testing.differential`) all read a reference as ``jsonschema`` does."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

__all__ = ["resolve_pointer"]

_INDEX = re.compile(r"0|[1-9][0-9]*")
"""An array index of RFC 6901, section 4: ASCII digits, no leading zero."""


def resolve_pointer(root: Any, ref: str) -> Any | None:
    """The node that local reference ``ref`` names in ``root``, else None (``ref`` not a
    local JSON pointer, e.g. ``"other.json#/a"`` or the anchor ``"#foo"``; a step that names
    no member or index). ``ref`` is a URI fragment (RFC 3986): it is percent-decoded first,
    then read as a JSON pointer (RFC 6901): split at ``/``, each part's ``~1`` read as ``/``
    and then ``~0`` as ``~`` (so ``"#/a~1b/%25"`` names ``root["a/b"]["%"]`` and ``"#/%7E01"``
    names ``root["~1"]``); ``"#"`` names ``root``. A target that is JSON ``null`` also gives
    None (no schema is null). Time: the length of ``ref``."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return None
    node = root
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and _INDEX.fullmatch(part) and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
