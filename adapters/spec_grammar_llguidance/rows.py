"""One row of llguidance's mask, completed to the grammar's allowed set, and the checks around
the native matcher's calls (see the package docstring for why rows are completed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from spec_grammar.errors import GrammarStateError

from .vocab import VocabIndex

# numpy's C function: np.count_nonzero's Python wrapper costs a third of the count on a
# 49k-token row, once per filled row
try:
    from numpy._core.multiarray import count_nonzero as _count_nonzero
except ImportError:  # numpy < 2
    from numpy.core.multiarray import count_nonzero as _count_nonzero

__all__ = ["check_native", "complete_row", "complete_single", "consume_native", "fill_row"]


def consume_native(matcher: Any, token: int) -> None:
    """Consume a token its row allowed; a refusal would mean llguidance's mask and parser
    disagree, so it is reported instead of ignored."""
    if not matcher.consume_token(token):
        raise GrammarStateError(
            f"llguidance refused token {token} that its row allowed: {matcher.get_error()}"
        )


def fill_row(matcher: Any, row: np.ndarray, vocab: VocabIndex) -> None:
    """Write the state's allowed set into ``row`` (a ``(W,)`` int32 view): llguidance's mask,
    then :func:`complete_row`. Raises :class:`GrammarStateError` if llguidance fails."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    check_native(matcher)
    complete_row(matcher, row, vocab)


def check_native(matcher: Any) -> None:
    """Raise :class:`GrammarStateError` when the native matcher is in its error state."""
    if matcher.is_error():
        raise GrammarStateError(f"llguidance matcher failed: {matcher.get_error()}")


def complete_row(matcher: Any, row: np.ndarray, vocab: VocabIndex) -> None:
    """Add the non-canonical spellings of forced text to a row llguidance filled (see the
    package docstring). Only a single-token row can be such a row. Candidates are the tokens
    whose bytes are a proper prefix of the forced bytes or start with them, each checked by
    llguidance's parser (``validate_tokens`` never mutates). Validity is prefix-closed (a
    token is allowed iff its bytes can begin the rest of a document), which lets
    :meth:`VocabIndex.extensions_accepted` skip the extensions of a refused token."""
    if _count_nonzero(row) == 1:
        complete_single(matcher, row, vocab)


def complete_single(matcher: Any, row: np.ndarray, vocab: VocabIndex) -> None:
    """:func:`complete_row` for a row already known to have one non-zero word (the tree walks
    count the words themselves, saving a call per row)."""
    bits = row.view(np.uint32)
    # the one non-zero word is the largest as unsigned: argmax finds it without allocating
    # (flatnonzero took ~18 µs on a 262k-token row)
    word = int(bits[bits.argmax()])
    if word & (word - 1):
        return
    # only the first max_token_bytes + 1 bytes can begin or hold a token: a longer forced run
    # (a 100 kB const) made every fill walk all of its prefixes (a second per row)
    forced = matcher.compute_ff_bytes()[: vocab.max_token_bytes + 1]
    if not forced:
        return

    def accepts(t: int) -> bool:
        return bool((int(bits[t >> 5]) >> (t & 31)) & 1) or matcher.validate_tokens([t]) == 1

    shorter = [t for t in vocab.proper_prefixes(forced) if accepts(t)]
    for t in shorter + vocab.extensions_accepted(forced, accepts):
        bits[t >> 5] |= np.uint32(1 << (t & 31))
