"""A compile-time probe of llguidance's first rows.

llguidance 1.9.1 compiles a schema past its Earley row limit (``LLParserLimits.
max_items_in_row``, default 2000: a flat object of ~500 optional properties) without a word;
its first row then allows ``{`` and consuming it fails ("Current row has 2007 items; max is
2000"), so every request on that schema dies at its second token. The probe walks a few rows
of a copy of the fresh matcher and consumes some allowed tokens of each: a refusal there is
reported at compile time instead.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from spec_grammar.json_schema.rewrite import map_subschemas

__all__ = ["ROW_LIMIT", "DEFAULT_MAX_ITEMS_IN_ROW", "first_rows_fault", "wide_object"]

DEFAULT_MAX_ITEMS_IN_ROW = 2000
"""llguidance 1.9.1's default ``LLParserLimits.max_items_in_row``."""

ROW_LIMIT = re.compile(r"Current row has \d+ items; max is \d+|ParserTooComplex")
"""llguidance's message for a parser state past ``max_items_in_row`` / ``step_max_items``."""


def first_rows_fault(
    prototype: Any,
    token_lengths: np.ndarray,
    stops: frozenset[int],
    *,
    steps: int = 3,
    tries: int = 6,
) -> str | None:
    """llguidance's error when a token its row allows near the start is refused, else None.

    Walks ``steps`` rows from a copy of ``prototype`` (an ``LLMatcher`` at the start state):
    each row is computed, its ``tries`` shortest allowed non-stop tokens are consumed on copies,
    and the walk goes on with the shortest (short tokens reach the most parser states per byte).
    ``token_lengths``: ``(V,)`` byte length of each token id. Costs ``steps`` masks and
    ``steps * tries`` consumes (under 2 ms on the SmolLM2 tokenizer, see docs/reliability.md).
    """
    words = (len(token_lengths) + 31) // 32
    m = prototype.deep_copy()
    row = np.zeros(words, dtype=np.int32)
    for _ in range(steps):
        row[:] = 0
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if m.is_error():  # no row here (nothing the vocabulary spells): the fill reports it
            return None
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: len(token_lengths)]
        allowed = np.flatnonzero(bits)
        allowed = allowed[~np.isin(allowed, list(stops))] if stops else allowed
        if not len(allowed):
            return None
        order = allowed[np.argsort(token_lengths[allowed], kind="stable")[:tries]]
        for t in order.tolist():
            c = m.deep_copy()
            if not c.consume_token(t) or c.is_error():
                return c.get_error() or f"token {t} of its row refused"
        m.consume_token(int(order[0]))
        if m.is_stopped():
            return None
    return None


def wide_object(schema: Any, max_items_in_row: int) -> tuple[str, int] | None:
    """``(pointer, n)`` of the first object whose ``n`` leading optional properties (those
    before its first required one) put llguidance's row at its ``{`` past ``max_items_in_row``,
    else None. The row holds about ``4 n + 7`` Earley items (measured, llguidance 1.9.1: 2007
    for 500, 4007 for 1000; 499 fails and 450 passes at the default 2000; the properties' own
    schemas do not change it). Finds what the first-rows probe cannot reach: a wide object
    nested under an optional property. Optional properties after a required one are not
    counted (measured: 499 of them after two required ones pass)."""
    found: list[tuple[str, int]] = []

    def visit(node: dict[str, Any], where: str) -> dict[str, Any]:
        props = node.get("properties")
        if not found and isinstance(props, dict):
            required = node.get("required")
            required = set(required) if isinstance(required, list) else set()
            n = next((i for i, name in enumerate(props) if name in required), len(props))
            if 4 * n + 7 > max_items_in_row:
                found.append((where or "/", n))
        return node

    map_subschemas(schema, visit)
    return found[0] if found else None
