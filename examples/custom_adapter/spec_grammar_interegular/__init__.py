"""A third-party spec-grammar backend: regular expressions on a byte-level DFA (interegular).

An example of writing an adapter outside the spec-grammar distribution (guide:
``docs/writing-an-adapter.md``). It is registered through the ``spec_grammar.backends`` entry
point under the name ``interegular``, so ``get_backend("interegular", tokenizer)`` and
``spec-grammar generate --grammar-backend interegular --regex ...`` find it once installed.

How it works: interegular parses the pattern into a character DFA; :mod:`.bytedfa` expands it
to a byte DFA. A matcher's state is one integer; its history is a persistent linked list of
those integers shared between forks, so fork is O(1), rollback(k) follows k links and accept
adds one. The allowed-token row of a DFA state is computed the first time it is needed by
walking every token's bytes through the DFA (vectorized with numpy) and cached on the compiled
grammar, shared by all its matchers (``4 * ceil(V/32)`` bytes per visited state).

Implemented natively: accept, rollback, fork, mask fill, termination and validation (a
side-effect-free walk). Left to spec-grammar's generic fallbacks: tree fill
(``traverse.fill_tree_bitmask_dfs``), forced tokens (``traverse.forced_tokens_by_mask``) and
multi-token accept.
"""

from __future__ import annotations

import importlib.metadata
import re
import threading
from typing import Any

import numpy as np
import torch

from spec_grammar.compile import LibraryResult
from spec_grammar.errors import GrammarCompileError, UnsupportedGrammarError
from spec_grammar.protocol import (
    Capabilities,
    CompiledGrammar,
    GrammarBackend,
    SpecGrammar,
    TokenizerInfo,
)
from spec_grammar.specs import GrammarSpec, Regex

try:
    import interegular
except ImportError as e:  # pragma: no cover - exercised when the dependency is missing
    raise ImportError("the interegular backend needs `pip install interegular`") from e

from .bytedfa import DEAD, ByteDFA, EmptyLanguageError, TokenTable

__all__ = ["InteregularBackend", "InteregularMatcher", "RegexGrammar"]

_CLASS_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\[dDwWsS]")
_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?<?[=!]")
"""An unescaped ``(?=``, ``(?!``, ``(?<=`` or ``(?<!``: interegular 0.3 parses look-arounds but
gets them wrong (``(?!ab)[a-z]+`` took ``x!``; ``(?!.{4})[a-z]+`` refused ``abc``), so they are
refused rather than served."""
_ASCII_CLASSES = (
    "regex:refuses at /: interegular 0.3 reads \\d \\w \\s (and their negations) as ASCII "
    "classes, where Python's re takes them Unicode-wide: other letters, digits and spaces are refused"
)

_TERMINATED = -1
"""History entry meaning "a stop token was accepted"."""


class RegexGrammar:
    """A compiled pattern: its byte DFA plus a lazily filled cache of bitmask rows per state.

    Thread-safe: two threads needing the same row may both compute it (same result).
    """

    def __init__(self, dfa: ByteDFA, tokens: TokenTable, info: TokenizerInfo):
        self.dfa = dfa
        self.tokens = tokens
        self.info = info
        self._rows: dict[int, np.ndarray] = {}

    def mask_row(self, state: int) -> np.ndarray:
        """``(ceil(V/32),)`` int32 bitmask row of ``state``: the tokens whose bytes keep the DFA
        alive, plus the stop tokens where the pattern is fully matched."""
        row = self._rows.get(state)
        if row is None:
            allowed = np.zeros(self.info.bitmask_width * 32, dtype=bool)
            allowed[self.tokens.allowed_ids(self.dfa, state)] = True
            if self.dfa.finals[state]:
                allowed[list(self.info.stop_token_ids)] = True
            row = np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)
            self._rows[state] = row
        return row

    @property
    def cached_rows(self) -> int:
        return len(self._rows)


_History = tuple  # (state, previous _History or None): immutable, so forks share it


class InteregularMatcher(SpecGrammar):
    """:class:`SpecGrammar` over a :class:`RegexGrammar`. State = the newest history entry."""

    def __init__(
        self,
        grammar: RegexGrammar,
        info: TokenizerInfo,
        max_rollback_tokens: int,
        history: _History,
    ):
        super().__init__(info, max_rollback_tokens=max_rollback_tokens)
        self._g = grammar
        self._history = history

    def _next(self, state: int, token: int) -> int:
        """State after ``token`` from ``state``, ``DEAD`` when refused."""
        if self.is_stop_token(token):
            return _TERMINATED if self._g.dfa.finals[state] else DEAD
        if token in self._g.tokens.excluded:
            return DEAD
        data = self.info.token_bytes[token]
        return self._g.dfa.walk(state, data) if data else DEAD

    # -- required hooks -----------------------------------------------------------------------
    def _accept_token(self, token: int) -> bool:
        nxt = self._next(self._history[0], token)
        if nxt == DEAD:
            return False
        self._history = (nxt, self._history)
        return True

    def _rollback(self, num_tokens: int) -> None:
        h = self._history
        for _ in range(num_tokens):
            h = h[1]
        self._history = h

    def _fork(self) -> InteregularMatcher:
        return InteregularMatcher(self._g, self.info, self._max_rollback_tokens, self._history)

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask.numpy()[row] = self._g.mask_row(self._history[0])

    def _is_terminated(self) -> bool:
        return self._history[0] == _TERMINATED

    # -- optional hook with a native path -----------------------------------------------------
    def _validate_tokens(self, tokens: list[int]) -> int:
        state = self._history[0]
        n = 0
        for t in tokens:
            if state == _TERMINATED:
                break
            state = self._next(state, t)
            if state == DEAD:
                break
            n += 1
        return n


class InteregularBackend(GrammarBackend):
    """Regular expressions (:class:`~spec_grammar.specs.Regex`) compiled by interegular.

    Supported syntax: Python ``re`` syntax without anchors, word boundaries, backreferences or
    lookbehinds (those raise :class:`UnsupportedGrammarError`). ``\\d``, ``\\w``, ``\\s`` are
    ASCII classes (as with ``re.ASCII``). Other grammar kinds raise
    :class:`UnsupportedGrammarError`.

    Cost: compiling builds the byte DFA (milliseconds for typical patterns); the first fill at
    each DFA state walks the vocabulary once (1-2 ms on SmolLM2's 49k tokens), later fills copy
    the cached row (`measure.py` beside the package prints these next to xgrammar).
    """

    name = "interegular"
    library_requirement = "interegular>=0.3.3"  # the package's own pin
    capabilities = Capabilities(
        json_schema=False,
        regex=True,
        ebnf=False,
        lark=False,
        tool_calls=False,
    )

    def __init__(self, tokenizer: Any, **kwargs: Any):
        super().__init__(tokenizer, **kwargs)
        self._tokens: TokenTable | None = None
        self._tokens_lock = threading.Lock()

    @classmethod
    def library_version(cls) -> str:
        return importlib.metadata.version("interegular")

    def token_table(self) -> TokenTable:
        """The vocabulary as a byte matrix (built on first use, shared by every grammar)."""
        with self._tokens_lock:
            if self._tokens is None:
                info = self.tokenizer_info
                excluded = frozenset(info.special_token_ids) | frozenset(info.stop_token_ids)
                self._tokens = TokenTable(info.token_bytes, excluded)
            return self._tokens

    def _compile(self, spec: GrammarSpec) -> RegexGrammar | LibraryResult:
        if not isinstance(spec, Regex):
            raise UnsupportedGrammarError(
                f"{spec.kind} is not supported by interegular (regex only)"
            )
        if _LOOKAROUND.search(spec.pattern):
            raise UnsupportedGrammarError(
                f"regex {spec.pattern!r}: look-arounds are not supported by this adapter "
                "(interegular 0.3 builds a wrong automaton for them)"
            )
        try:
            fsm = interegular.parse_pattern(spec.pattern).to_fsm()
        except interegular.Unsupported as e:
            raise UnsupportedGrammarError(f"regex feature not supported by interegular: {e}") from e
        except interegular.InvalidSyntax as e:
            raise GrammarCompileError(f"invalid regex {spec.pattern!r}: {e}") from e
        try:
            dfa = ByteDFA.from_fsm(fsm)
        except EmptyLanguageError as e:
            raise GrammarCompileError(f"regex {spec.pattern!r}: {e}") from e
        grammar = RegexGrammar(dfa, self.token_table(), self.tokenizer_info)
        if _CLASS_ESCAPE.search(spec.pattern):
            # declared, never silent: Python's re (the Regex spec's reading) takes them Unicode-wide
            return LibraryResult(grammar, (_ASCII_CLASSES,))
        return grammar

    def _matcher(self, compiled: CompiledGrammar) -> InteregularMatcher:
        grammar: RegexGrammar = compiled.native
        return InteregularMatcher(
            grammar, self.tokenizer_info, self.max_rollback_tokens, (grammar.dfa.initial, None)
        )
