"""A byte-level DFA built from interegular's character FSM, and token masks walked through it.

interegular (https://github.com/MegaIng/interegular) compiles a Python-style regular expression
into a DFA over Unicode *characters*. Its alphabet groups the characters the pattern names into
symbols; the special symbol ``anything_else`` stands for every character the pattern does not
name. Tokens are *byte* strings and may stop in the middle of a multi-byte UTF-8 character, so
this module expands every character transition into UTF-8 byte transitions (the construction
behind outlines' ``make_byte_level_fsm``), keeping the automaton small:

- a character state ``("c", s)``: no bytes pending;
- a prefix state ``("p", s, prefix)``: the pending bytes start the encoding of a character the
  pattern names, so the next byte decides between named characters;
- an "unnamed" state ``("a", t, need, lo, hi)``: the pending bytes can only complete characters
  the pattern does not name, all of which lead to character state ``t``; ``need`` bytes remain,
  the next one in ``[lo, hi]``. These are shared by every state whose ``anything_else`` goes to
  ``t``, so ``.`` costs 7 extra states per target instead of one per UTF-8 prefix.

Only well-formed UTF-8 is accepted (no overlong forms, no surrogates, nothing above U+10FFFF:
the Unicode standard's Table 3-7), so whatever the DFA accepts decodes to text that the pattern
matches. States that cannot reach a final state are merged into the dead state 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
from interegular.fsm import FSM, anything_else

__all__ = ["DEAD", "ByteDFA", "EmptyLanguageError", "TokenTable"]

DEAD = 0
"""The dead state: every byte leads back to it and it is never final."""

# Well-formed UTF-8 (Unicode Table 3-7): lead byte -> (bytes after it, range of the next byte).
_LEAD: dict[int, tuple[int, int, int]] = {}
for _b in range(0xC2, 0xE0):
    _LEAD[_b] = (1, 0x80, 0xBF)
for _b in range(0xE0, 0xF0):
    _LEAD[_b] = (2, 0x80, 0xBF)
_LEAD[0xE0] = (2, 0xA0, 0xBF)  # no overlong 3-byte forms
_LEAD[0xED] = (2, 0x80, 0x9F)  # no UTF-16 surrogates
for _b in range(0xF0, 0xF5):
    _LEAD[_b] = (3, 0x80, 0xBF)
_LEAD[0xF0] = (3, 0x90, 0xBF)  # no overlong 4-byte forms
_LEAD[0xF4] = (3, 0x80, 0x8F)  # nothing above U+10FFFF


class EmptyLanguageError(ValueError):
    """The pattern matches no string at all."""


@dataclass(eq=False)
class ByteDFA:
    """A deterministic automaton over bytes.

    Attributes:
        transitions: ``(S, 256)`` int32; ``transitions[s, b]`` is the state after byte ``b``
            (``DEAD`` = 0 when the byte cannot continue any match).
        finals: ``(S,)`` bool; True where the bytes read so far match the whole pattern.
        initial: the start state (never ``DEAD``).
    """

    transitions: np.ndarray
    finals: np.ndarray
    initial: int

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading ``data`` from ``state`` (``DEAD`` as soon as it dies)."""
        step = self.transitions.item
        for b in data:
            state = step(state, b)
            if state == DEAD:
                return DEAD
        return state

    @classmethod
    def from_fsm(cls, fsm: FSM) -> ByteDFA:
        """Expand interegular's character FSM into a byte DFA.

        Raises :class:`EmptyLanguageError` when no string matches the pattern.
        Cost: one Python step per (reachable byte state, valid next byte).
        """
        return _Builder(fsm).build()


class _Builder:
    def __init__(self, fsm: FSM):
        self.fsm = fsm
        self.live = _live_char_states(fsm)
        if fsm.initial not in self.live:
            raise EmptyLanguageError("the pattern matches no string")
        self.else_symbol = fsm.alphabet[anything_else]
        # UTF-8 encodings of the characters the pattern names, and all their proper prefixes.
        self.named: dict[bytes, Hashable] = {}
        self.prefixes: set[bytes] = set()
        for char, symbol in fsm.alphabet.items():
            if char is anything_else:
                continue
            try:
                enc = char.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: no UTF-8 text contains it
                continue
            self.named[enc] = symbol
            for i in range(1, len(enc)):
                self.prefixes.add(enc[:i])
        self.ids: dict[tuple, int] = {}
        self.rows: list[list[int] | None] = [None]  # row 0: DEAD
        self.queue: deque[tuple] = deque()

    def char_target(self, s: int, symbol: Hashable) -> int | None:
        t = self.fsm.map.get(s, {}).get(symbol)
        return t if t in self.live else None

    def state_id(self, key: tuple) -> int:
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = len(self.rows)
            self.rows.append(None)
            self.queue.append(key)
        return sid

    def after_char(self, s: int, enc: bytes) -> int:
        symbol = self.named.get(enc, self.else_symbol)
        t = self.char_target(s, symbol)
        return DEAD if t is None else self.state_id(("c", t))

    def after_partial(self, s: int, pending: bytes, need: int, lo: int, hi: int) -> int:
        if pending in self.prefixes:
            return self.state_id(("p", s, pending, need, lo, hi))
        t = self.char_target(s, self.else_symbol)
        return DEAD if t is None else self.state_id(("a", t, need, lo, hi))

    def row_of(self, key: tuple) -> list[int]:
        row = [DEAD] * 256
        kind = key[0]
        if kind == "c":
            s = key[1]
            for b in range(0x80):
                row[b] = self.after_char(s, bytes((b,)))
            for b, (need, lo, hi) in _LEAD.items():
                row[b] = self.after_partial(s, bytes((b,)), need, lo, hi)
        elif kind == "p":
            _, s, pending, need, lo, hi = key
            for b in range(lo, hi + 1):
                nxt = pending + bytes((b,))
                row[b] = (
                    self.after_char(s, nxt)
                    if need == 1
                    else self.after_partial(s, nxt, need - 1, 0x80, 0xBF)
                )
        else:  # "a": only unnamed characters can follow, all leading to t
            _, t, need, lo, hi = key
            nxt = (
                self.state_id(("c", t))
                if need == 1
                else self.state_id(("a", t, need - 1, 0x80, 0xBF))
            )
            for b in range(lo, hi + 1):
                row[b] = nxt
        return row

    def build(self) -> ByteDFA:
        initial = self.state_id(("c", self.fsm.initial))
        while self.queue:
            key = self.queue.popleft()
            self.rows[self.ids[key]] = self.row_of(key)
        self.rows[DEAD] = [DEAD] * 256
        table = np.asarray(self.rows, dtype=np.int32)
        finals = np.zeros(len(self.rows), dtype=bool)
        for key, sid in self.ids.items():
            finals[sid] = key[0] == "c" and key[1] in self.fsm.finals
        # A prefix state whose named completions all die is dead too: merge it into DEAD.
        live = _coreachable(table, finals)
        table[~live[table]] = DEAD
        table[~live] = DEAD
        return ByteDFA(table, finals, initial)


def _live_char_states(fsm: FSM) -> set[int]:
    """Character states from which some final state is reachable."""
    reverse: dict[int, set[int]] = {}
    for s, moves in fsm.map.items():
        for t in moves.values():
            reverse.setdefault(t, set()).add(s)
    live = set(fsm.finals)
    todo = list(live)
    while todo:
        for p in reverse.get(todo.pop(), ()):
            if p not in live:
                live.add(p)
                todo.append(p)
    return live


def _coreachable(table: np.ndarray, finals: np.ndarray) -> np.ndarray:
    """``(S,)`` bool: states from which a final state is reachable (DEAD never is)."""
    live = finals.copy()
    live[DEAD] = False
    while True:
        grown = live | live[table].any(axis=1)
        grown[DEAD] = False
        if (grown == live).all():
            return live
        live = grown


@dataclass(eq=False)
class TokenTable:
    """A vocabulary laid out for walking every token through a :class:`ByteDFA` at once.

    Args:
        token_bytes: ``token_bytes[i]`` = bytes of token ``i`` (``TokenizerInfo.token_bytes``).
        excluded: ids never walked (special and stop tokens); empty tokens are skipped too.

    Attributes:
        ids: ``(n,)`` int64, the walked token ids, longest token first.
        columns: ``(L, n)`` uint8, byte ``i`` of every walked token in row ``i`` (0-padded).
        longer_than: ``(L,)`` int64, ``longer_than[i]`` = how many tokens have more than ``i``
            bytes (they are the first ones, as ``ids`` is sorted by decreasing length).
    """

    token_bytes: Sequence[bytes]
    excluded: frozenset[int]
    ids: np.ndarray = field(init=False)
    columns: np.ndarray = field(init=False)
    longer_than: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        ids = [i for i, b in enumerate(self.token_bytes) if b and i not in self.excluded]
        ids.sort(key=lambda i: -len(self.token_bytes[i]))
        self.ids = np.asarray(ids, dtype=np.int64)
        lengths = np.asarray([len(self.token_bytes[i]) for i in ids], dtype=np.int64)
        width = int(lengths[0]) if ids else 0
        columns = np.zeros((len(ids), width), dtype=np.uint8)
        for row, i in enumerate(ids):
            data = self.token_bytes[i]
            columns[row, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.columns = np.ascontiguousarray(columns.T)
        self.longer_than = len(ids) - np.cumsum(np.bincount(lengths, minlength=width + 1))[:width]

    def allowed_ids(self, dfa: ByteDFA, state: int) -> np.ndarray:
        """Ids of the walked tokens that ``dfa`` can read from ``state`` without dying.

        Vectorized over the vocabulary: step ``i`` advances every token longer than ``i`` bytes
        by its ``i``-th byte (one gather in the flattened transition table). While most tokens
        are alive it works on contiguous slices; once most have died it follows only the
        living ones, so a restrictive state costs little more than its first byte.
        """
        flat = dfa.transitions.ravel()
        st = np.full(self.ids.size, state, dtype=np.int64)
        alive: np.ndarray | None = None  # None: every token of the slice may be alive
        for i, k in enumerate(self.longer_than.tolist()):
            if alive is None:
                nxt = flat[st[:k] * 256 + self.columns[i, :k]]
                st[:k] = nxt
                if 2 * np.count_nonzero(nxt) < k:
                    alive = np.flatnonzero(nxt)
            else:
                alive = alive[: np.searchsorted(alive, k)]
                if alive.size == 0:
                    break
                nxt = flat[st[alive] * 256 + self.columns[i, alive]]
                st[alive] = nxt
                alive = alive[nxt != DEAD]
        return self.ids[st != DEAD]
