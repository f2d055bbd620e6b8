"""Tagged tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, with free text
around them under ``tool_choice="auto"``.

:class:`TaggedToolCalls` is a :class:`~spec_grammar.protocol.SpecGrammar` over any backend: the
backend compiles the schema of one call (:meth:`ToolCalls.to_json_schema`); the wrapper runs
the text around the calls, finds the opening tag by bytes (however the model splits it into
tokens, across draft-tree nodes too), starts a fresh call matcher after it, sees the call's
JSON close, forces the closing tag, and bounds the number of calls. Being a ``SpecGrammar``
itself, it gets the tree fill, rollback and every drafter of the protocol with no special case
(the field faults it avoids: a trigger split over two draft tokens missed, the matcher fed after
it terminated, rows after the trigger left unconstrained).

:func:`parse_tool_calls` reads an output back as OpenAI's message fields.
"""

from __future__ import annotations

import json
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from .errors import GrammarSpecError, GrammarStateError
from .protocol import SpecGrammar
from .specs import ToolCalls
from .tokenizer_info import TokenizerInfo
from .vocab import encode_ids

__all__ = ["TaggedToolCalls", "parse_tool_calls"]

_WS = b" \t\r\n"
_TREE_DEPTH_MARGIN = 64
FREE, OPEN, CALL, CLOSE, END = range(5)
"""Modes: free text (``auto``), writing the opening tag (forced, ``required``), inside a call's
JSON, writing the closing tag (forced), only a stop token left."""


class _Snapshot(NamedTuple):
    mode: int
    pos: int
    pad: bool
    tail: bytes
    scan: tuple[int, bool, bool]
    calls: int
    call: SpecGrammar | None
    call_no: int
    advanced_call: bool
    terminated: bool


def _spell(info: TokenizerInfo, text: str, what: str) -> tuple[bytes, tuple[int, ...]]:
    """The tag's bytes and canonical ids. Raises :class:`GrammarSpecError` for a tag of
    whitespace only (free text could never hold a space), one holding a stop token (it would
    end the output) and one the tokenizer does not spell back exactly."""
    raw = text.encode()
    if not raw.strip(_WS):
        raise GrammarSpecError(f"the {what} {text!r} is whitespace only")
    ids = tuple(encode_ids(info.hf_tokenizer, text))
    if set(ids) & set(info.stop_token_ids):
        raise GrammarSpecError(f"the {what} {text!r} holds a stop token")
    if b"".join(info.token_bytes[t] for t in ids) != raw:
        raise GrammarSpecError(f"the tokenizer does not spell the {what} {text!r} back exactly")
    return raw, ids


_ban_tables: weakref.WeakKeyDictionary[TokenizerInfo, dict[bytes, list[np.ndarray]]] = (
    weakref.WeakKeyDictionary()
)


def _split_trigger_tokens(info: TokenizerInfo, trigger: bytes) -> list[np.ndarray]:
    """``tables[j]``: ids of the tokens that would complete ``trigger`` after its first ``j``
    bytes with more than whitespace after it in the same token (the tag would end inside the
    token, where the call's grammar cannot take over), ``j = 0 .. len(trigger) - 1``. Free
    text may not use them: every tag the model writes is then seen. One vocabulary scan per
    tokenizer and tag."""
    per_info = _ban_tables.setdefault(info, {})
    if trigger not in per_info:
        n = len(trigger)
        banned: list[list[int]] = [[] for _ in range(n)]
        firsts = set(trigger)
        for t, b in enumerate(info.token_bytes):
            at = b.find(trigger)  # anywhere in the token
            if at >= 0 and b[at + n :].strip(_WS):
                banned[0].append(t)
            if not b or b[0] not in firsts:
                continue
            for j in range(1, n):
                if b.startswith(trigger[j:]) and b[n - j :].strip(_WS):
                    banned[j].append(t)
        per_info[trigger] = [np.array(ids, dtype=np.int64) for ids in banned]
    return per_info[trigger]


_ws_tables: weakref.WeakKeyDictionary[TokenizerInfo, np.ndarray] = weakref.WeakKeyDictionary()


def _whitespace_tokens(info: TokenizerInfo) -> np.ndarray:
    """Ids of the tokens made of JSON whitespace only (sorted int64)."""
    if info not in _ws_tables:
        _ws_tables[info] = np.array(
            [t for t, b in enumerate(info.token_bytes) if b and not b.strip(_WS)], dtype=np.int64
        )
    return _ws_tables[info]


_tag_tables: weakref.WeakKeyDictionary[
    TokenizerInfo, dict[tuple[bytes, bool], list[np.ndarray]]
] = weakref.WeakKeyDictionary()


def _tag_tokens(info: TokenizerInfo, tag: bytes, *, ws_after: bool) -> list[np.ndarray]:
    """``tables[p]``: ids of the tokens that may come after the tag's first ``p`` bytes: those
    whose bytes continue the tag, and with ``ws_after`` those that end it followed by
    whitespace only. One vocabulary scan per tokenizer and tag."""
    per_info = _tag_tables.setdefault(info, {})
    key = (tag, ws_after)
    if key not in per_info:
        n = len(tag)
        allowed: list[list[int]] = [[] for _ in range(n)]
        firsts = set(tag)
        for t, b in enumerate(info.token_bytes):
            if not b or b[0] not in firsts:
                continue
            for p in range(n):
                if tag.startswith(b, p) or (
                    ws_after and b.startswith(tag[p:]) and not b[n - p :].strip(_WS)
                ):
                    allowed[p].append(t)
        per_info[key] = [np.array(ids, dtype=np.int64) for ids in allowed]
    return per_info[key]


class TaggedToolCalls(SpecGrammar):
    """Calls in tags, free text around them under ``tool_choice="auto"``.

    Args:
        new_call_matcher: makes a fresh matcher of one call's JSON (the backend's compile of
            ``spec.to_json_schema()``); called once per call.
        spec: the :class:`~spec_grammar.specs.ToolCalls` spec (``call_format == "tagged"``).
        info, max_rollback_tokens: those of the backend making the call matchers.

    Output: under ``"auto"``, free text with calls anywhere, then a stop token; otherwise one
    or more calls (``call_open`` + JSON + ``call_close``) back to back, then a stop token. At
    most ``spec.max_calls`` calls; once reached, only a stop token. Free text may not hold a
    token inside which the opening tag would end with more text after it. Rows are
    ``(rows, ceil(V / 32))`` int32 token bitmasks.

    Raises :class:`GrammarSpecError` when the tokenizer cannot spell a tag exactly.
    """

    def __init__(
        self,
        new_call_matcher: Callable[[], SpecGrammar],
        spec: ToolCalls,
        info: TokenizerInfo,
        *,
        max_rollback_tokens: int,
    ):
        super().__init__(info, max_rollback_tokens=max_rollback_tokens)
        self._new_call = new_call_matcher
        self.open_tag, self.open_ids = _spell(info, spec.call_open, "opening tag")
        self.close_tag, self.close_ids = _spell(info, spec.call_close, "closing tag")
        self._open_tokens = _tag_tokens(info, self.open_tag, ws_after=True)
        self._close_tokens = _tag_tokens(info, self.close_tag, ws_after=False)
        self.auto = spec.tool_choice == "auto"
        self.max_calls = spec.max_calls
        self._banned = _split_trigger_tokens(info, self.open_tag) if self.auto else []
        self._ws_tokens = _whitespace_tokens(info)
        self._ws_set = frozenset(self._ws_tokens.tolist())
        self._stop_array = np.array(sorted(self._stop_ids), dtype=np.int64)
        self._mode = FREE if self.auto else OPEN
        self._pos = 0
        self._pad = False  # the one whitespace token allowed before a call / its closing tag
        self._tail = b""
        self._scan = (0, False, False)  # JSON depth, inside a string, after a backslash
        self._calls = 0  # calls closed
        self._call: SpecGrammar | None = None
        self._call_no = 0  # bumped whenever _call changes (rollback re-forks an older one)
        self._terminated = False
        self._history: deque[_Snapshot] = deque(
            maxlen=self.max_rollback_tokens + _TREE_DEPTH_MARGIN
        )

    @property
    def num_calls(self) -> int:
        """Calls closed so far."""
        return self._calls

    def _stop_allowed(self) -> bool:
        if self._mode == FREE or self._mode == END:
            return True
        return self._mode == OPEN and self._pos == 0 and self._calls > 0

    # -- hooks ----------------------------------------------------------------------------
    def _accept_token(self, token: int) -> bool:
        if token in self._stop_ids:
            if not self._stop_allowed():
                return False
            self._push(advanced_call=False)
            self._terminated = True
            return True
        mode = self._mode
        if mode == END:
            return False
        if self._pad_allowed() and token in self._ws_set:
            self._push(advanced_call=False)
            self._pad = True
            return True
        if mode == CALL:
            if not self._call.accept_token(token):
                return False
            self._push(advanced_call=True)
            self._scan, closed = _scan_json(self._scan, self.info.token_bytes[token])
            if closed:  # the call's object is complete: the closing tag comes next
                self._mode, self._pos, self._pad = CLOSE, 0, False
            return True
        if mode in (OPEN, CLOSE):  # self._pos: bytes of the tag written
            tag = self.open_tag if mode == OPEN else self.close_tag
            if not np.any(self._tag_table()[self._pos] == token):
                return False
            self._push(advanced_call=False)
            self._pos = min(self._pos + len(self.info.token_bytes[token]), len(tag))
            if self._pos == len(tag):
                self._start_call() if mode == OPEN else self._end_call()
            return True
        # FREE
        if any(np.any(self._banned[j] == token) for j in self._partial_matches()):
            return False
        self._push(advanced_call=False)
        text = self._tail + self.info.token_bytes[token]
        keep = len(self.open_tag) - 1
        self._tail = text[-keep:] if keep else b""
        stripped = text.rstrip(_WS)
        if text.endswith(self.open_tag) or (stripped != text and stripped.endswith(self.open_tag)):
            self._start_call()
        return True

    def _pad_allowed(self) -> bool:
        """One whitespace token may sit between the opening tag and the call's JSON and
        between the JSON and the closing tag (Hermes writes ``<tool_call>\\n{...}\\n``)."""
        if self._pad:
            return False
        if self._mode == CALL:
            return self._call.num_accepted == 0
        return self._mode == CLOSE and self._pos == 0

    def _partial_matches(self) -> list[int]:
        """``j`` such that the free text ends with the tag's first ``j`` bytes (0 included)."""
        tag, tail = self.open_tag, self._tail
        return [0] + [j for j in range(1, len(tag)) if tail.endswith(tag[:j])]

    def _push(self, *, advanced_call: bool) -> None:
        self._history.append(
            _Snapshot(
                self._mode,
                self._pos,
                self._pad,
                self._tail,
                self._scan,
                self._calls,
                self._call,
                self._call_no,
                advanced_call,
                self._terminated,
            )
        )

    def _start_call(self) -> None:
        self._mode, self._pos, self._scan, self._pad = CALL, 0, (0, False, False), False
        self._call = self._new_call()
        self._call_no += 1

    def _end_call(self) -> None:
        self._calls += 1
        self._call = None
        self._call_no += 1
        self._pos, self._tail = 0, b""
        if self.max_calls is not None and self._calls >= self.max_calls:
            self._mode = END
        else:
            self._mode = FREE if self.auto else OPEN

    def _rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise GrammarStateError(
                f"rollback({num_tokens}) reaches past the {len(self._history)} tokens of state "
                "kept (max_rollback_tokens + a draft-tree depth margin)"
            )
        for _ in range(num_tokens):
            snap = self._history.pop()
            if snap.advanced_call:
                self._call.rollback(1)
            if snap.call_no != self._call_no:  # back into an earlier call: a copy of its end
                self._call = None if snap.call is None else snap.call.fork()
            (
                self._mode,
                self._pos,
                self._pad,
                self._tail,
                self._scan,
                self._calls,
                _,
                self._call_no,
                _,
                self._terminated,
            ) = snap

    def _fork(self) -> TaggedToolCalls:
        child = object.__new__(TaggedToolCalls)
        child.__dict__.update(self.__dict__)
        child._history = self._history.copy()
        if self._call is not None:
            child._call = self._call.fork()
        return child

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask.numpy()[row].view(np.uint32)
        mode = self._mode
        if mode == CALL:
            self._call.fill_next_token_bitmask(bitmask, row)
        elif mode == FREE:
            words[:] = 0xFFFFFFFF  # padding ids are cleared by the public method
            for j in self._partial_matches():
                _clear(words, self._banned[j])
        else:
            words[:] = 0
            if mode in (OPEN, CLOSE):
                _set(words, self._tag_table()[self._pos])
        if self._pad_allowed():
            _set(words, self._ws_tokens)
        if self._stop_allowed():
            _set(words, self._stop_array)
        else:
            _clear(words, self._stop_array)

    def _tag_table(self) -> list[np.ndarray]:
        return self._open_tokens if self._mode == OPEN else self._close_tokens

    def _tag_rest_ids(self) -> list[int]:
        """The canonical tokens of the rest of the tag being written (none when the tag was
        cut inside a UTF-8 character: only a token finishing those bytes fits there)."""
        tag = self.open_tag if self._mode == OPEN else self.close_tag
        try:
            rest = tag[self._pos :].decode("utf-8")
        except UnicodeDecodeError:
            return []
        return encode_ids(self.info.hf_tokenizer, rest)

    def _is_terminated(self) -> bool:
        return self._terminated

    def _forced_tokens(self) -> list[int]:
        if self._mode == CALL:
            return self._call.forced_tokens()
        if self._mode in (OPEN, CLOSE) and not self._stop_allowed():
            return self._tag_rest_ids()
        return []

    def _validate_tokens(self, tokens: list[int]) -> int:
        return self._fork()._accept_tokens(tokens)


def _set(words: np.ndarray, ids: np.ndarray) -> None:
    if len(ids):
        np.bitwise_or.at(words, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))


def _clear(words: np.ndarray, ids: np.ndarray) -> None:
    if len(ids):
        np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def _scan_json(state: tuple[int, bool, bool], data: bytes) -> tuple[tuple[int, bool, bool], bool]:
    """((depth, in string, escaped) after ``data``, whether the outermost value closed in
    it): enough to see where the call's JSON object ends (the grammar has checked the rest)."""
    depth, in_str, esc = state
    for c in data:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x7B, 0x5B):
            depth += 1
        elif c in (0x7D, 0x5D):
            depth -= 1
            if depth == 0:
                return (depth, in_str, esc), True
    return (depth, in_str, esc), False


def parse_tool_calls(text: str, spec: ToolCalls) -> tuple[str | None, list[dict[str, Any]]]:
    """An output read back as OpenAI's assistant message: ``(content, tool_calls)``, each call
    ``{"name": str, "arguments": dict}``.

    ``json_array``: the whole text is the array (content None). ``tagged``: after each
    ``call_open``, (whitespace and) one JSON value, (whitespace and) ``call_close``, read as the
    grammar reads them (a ``call_close`` inside a JSON string does not end the call); the rest,
    stripped, is the content (None when empty). Raises ``ValueError`` on a call that is not
    JSON or not closed (an output cut at the token limit)."""
    if spec.call_format == "json_array":
        return None, list(json.loads(text))
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    pos = 0
    while (start := text.find(spec.call_open, pos)) >= 0:
        content.append(text[pos:start])
        at = _skip_ws(text, start + len(spec.call_open))
        call, at = decoder.raw_decode(text, at)
        at = _skip_ws(text, at)
        if not text.startswith(spec.call_close, at):
            raise ValueError(f"tool call at character {start} is not closed by {spec.call_close!r}")
        calls.append(call)
        pos = at + len(spec.call_close)
    content.append(text[pos:])
    joined = "".join(content).strip()
    return joined or None, calls


def _skip_ws(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at
