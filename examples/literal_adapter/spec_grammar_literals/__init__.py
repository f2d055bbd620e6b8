"""A narrow spec-grammar backend: regexes that are alternations of literal strings.

It claims ``regex`` only in part (``Capabilities.subsets``) and gives the conformance suite
its own cases (:meth:`LiteralsBackend.conformance_cases`), so ``spec-grammar conformance``
tests what it claims and no more (guide: ``docs/writing-an-adapter.md``, "A narrow adapter").

How it works: a compiled grammar is the set of literals as UTF-8 bytes. A matcher's state is
the bytes accepted so far (always a prefix of some literal); its history is a persistent linked
list shared between forks. The allowed tokens after prefix ``p`` are the tokens whose bytes
are a prefix of some literal's rest after ``p``: looked up in a ``bytes -> token ids`` index,
one lookup per byte of the rests, so a row never scans the vocabulary. EOS is allowed where
``p`` is a whole literal.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from spec_grammar.capabilities import ConformanceCase
from spec_grammar.errors import UnsupportedGrammarError
from spec_grammar.protocol import (
    Capabilities,
    CompiledGrammar,
    GrammarBackend,
    SpecGrammar,
    TokenizerInfo,
)
from spec_grammar.specs import GrammarSpec, Regex

__all__ = ["LiteralsBackend", "LiteralsMatcher", "literals_of"]

_META = set(".^$*+?{}[]\\|()")
_TERMINATED = None
"""Matcher state after a stop token."""


def literals_of(pattern: str) -> list[str]:
    """The literal strings of ``pattern`` when it is ``lit|lit|...`` (optionally wrapped in one
    ``(...)`` or ``(?:...)`` group; metacharacters escaped with a backslash). Raises
    :class:`UnsupportedGrammarError` naming the first construct that is not a literal."""
    body = pattern
    for opening in ("(?:", "("):
        if body.startswith(opening) and body.endswith(")") and _one_group(body, len(opening)):
            body = body[len(opening) : -1]
            break
    out, current, i = [], [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            if i + 1 == len(body) or body[i + 1].isalnum():
                raise UnsupportedGrammarError(
                    f"regex {pattern!r}: {body[i : i + 2]!r} at {i} is not an escaped literal "
                    "(this backend compiles alternations of literal strings only)"
                )
            current.append(body[i + 1])
            i += 2
            continue
        if ch == "|":
            out.append("".join(current))
            current = []
        elif ch in _META:
            raise UnsupportedGrammarError(
                f"regex {pattern!r}: {ch!r} at {i} is not a literal (this backend compiles "
                "alternations of literal strings only)"
            )
        else:
            current.append(ch)
        i += 1
    out.append("".join(current))
    return out


def _one_group(body: str, start: int) -> bool:
    """True when the group opened before ``start`` closes at the last character."""
    depth, i = 1, start
    while i < len(body):
        if body[i] == "\\":
            i += 2
            continue
        depth += {"(": 1, ")": -1}.get(body[i], 0)
        if depth == 0:
            return i == len(body) - 1
        i += 1
    return False


class LiteralGrammar:
    """A compiled alternation: its literals (bytes), every prefix of them, and bitmask rows
    cached per prefix (thread-safe: two threads may compute one row, with the same result)."""

    def __init__(self, literals: list[str], index: dict[bytes, list[int]], info: TokenizerInfo):
        self.literals = frozenset(s.encode() for s in literals)
        self.prefixes = frozenset(lit[:k] for lit in self.literals for k in range(len(lit) + 1))
        self._index = index
        self._info = info
        self._rows: dict[bytes, np.ndarray] = {}

    def mask_row(self, prefix: bytes) -> np.ndarray:
        """``(ceil(V/32),)`` int32 bitmask row after ``prefix``."""
        row = self._rows.get(prefix)
        if row is None:
            allowed = np.zeros(self._info.bitmask_width * 32, dtype=bool)
            for lit in self.literals:
                if lit.startswith(prefix):
                    rest = lit[len(prefix) :]
                    for k in range(1, len(rest) + 1):
                        allowed[self._index.get(rest[:k], [])] = True
            if prefix in self.literals:
                allowed[list(self._info.stop_token_ids)] = True
            row = np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)
            self._rows[prefix] = row
        return row


_History = tuple  # (state, previous _History or None): immutable, so forks share it


class LiteralsMatcher(SpecGrammar):
    """:class:`SpecGrammar` over a :class:`LiteralGrammar`; state = the newest history entry."""

    def __init__(
        self, grammar: LiteralGrammar, info: TokenizerInfo, max_rollback: int, history: _History
    ):
        super().__init__(info, max_rollback_tokens=max_rollback)
        self._g = grammar
        self._history = history

    def _accept_token(self, token: int) -> bool:
        prefix = self._history[0]
        if self.is_stop_token(token):
            if prefix not in self._g.literals:
                return False
            self._history = (_TERMINATED, self._history)
            return True
        if token in self.info.special_token_ids:
            return False
        data = self.info.token_bytes[token]
        if not data or prefix + data not in self._g.prefixes:
            return False
        self._history = (prefix + data, self._history)
        return True

    def _rollback(self, num_tokens: int) -> None:
        h = self._history
        for _ in range(num_tokens):
            h = h[1]
        self._history = h

    def _fork(self) -> LiteralsMatcher:
        return LiteralsMatcher(self._g, self.info, self._max_rollback_tokens, self._history)

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask.numpy()[row] = self._g.mask_row(self._history[0])

    def _is_terminated(self) -> bool:
        return self._history[0] is _TERMINATED


class LiteralsBackend(GrammarBackend):
    """Regexes that are alternations of literal strings (:func:`literals_of`); other regexes
    and other kinds raise :class:`UnsupportedGrammarError`.

    Cost: compiling stores the literals and their prefixes; a row costs one dict lookup per
    byte of the literals still possible (cached per prefix)."""

    name = "literals"
    capabilities = Capabilities(
        json_schema=False,
        regex=True,
        ebnf=False,
        lark=False,
        tool_calls=False,
        subsets={"regex": "alternations of literal strings"},
    )

    def __init__(self, tokenizer: Any, **kwargs: Any):
        super().__init__(tokenizer, **kwargs)
        info = self.tokenizer_info
        excluded = set(info.special_token_ids) | set(info.stop_token_ids)
        index: dict[bytes, list[int]] = defaultdict(list)
        for t, data in enumerate(info.token_bytes):
            if data and t not in excluded:
                index[data].append(t)
        self._index = dict(index)

    @classmethod
    def conformance_cases(cls, fixture: str) -> list[ConformanceCase]:
        # literals that are prefixes of others (EOS mid-document), multi-byte characters the
        # vocabulary also splits into single bytes, escaped metacharacters
        if fixture == "toy":
            words = ['{"a":1}', '{"a":12,"b":2}', "1", "12", "121", "x", "é", "éé"]
        else:
            words = ["yes", "no", "maybe", "yes, sure", "light blue", "C++", "café", "naïve?"]
        pattern = "|".join(re.escape(w) for w in words)
        return [ConformanceCase(Regex(pattern), documents=tuple(words))]

    def _compile(self, spec: GrammarSpec) -> LiteralGrammar:
        if not isinstance(spec, Regex):
            raise UnsupportedGrammarError(f"{spec.kind} is not supported by literals (regex only)")
        return LiteralGrammar(literals_of(spec.pattern), self._index, self.tokenizer_info)

    def _matcher(self, compiled: CompiledGrammar) -> LiteralsMatcher:
        return LiteralsMatcher(
            compiled.native, self.tokenizer_info, self.max_rollback_tokens, (b"", None)
        )
