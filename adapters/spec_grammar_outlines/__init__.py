"""outlines-core adapter for spec-grammar.

outlines-core 0.2.14 compiles a regex (JSON Schema through ``build_regex_from_schema``) into an
``Index``: a token-level DFA over the vocabulary. Its ``Guide`` is not used: copying one pickles
the whole Index (60 ms .. 1.3 s), its rollback is a ring of 32 states, ``reset()`` keeps that
history and ``advance(EOS)`` raises even in a final state (outlines-core issue #227). Instead
the matcher tracks the integer DFA state itself with ``Index.get_next_state`` and keeps the list
of past states, so every protocol operation is emulated cheaply:

- rollback(k): pop k states; fork: a copy of the (bounded) state list;
- termination: a stop token accepted in a final state (``Index.is_final_state``);
- masks: ``Index.get_allowed_tokens(state)`` packed into the protocol's int32 layout once per
  DFA state and kept in a bounded LRU on the compiled grammar (tree walks revisit the same
  states constantly), so a fill is a row copy;
- tree fill, validation and forced tokens: loops over integer states, no matcher mutation.

No context-free grammars: ``Ebnf`` and ``Lark`` raise ``UnsupportedGrammarError`` at compile.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from spec_grammar.errors import GrammarCompileError, UnsupportedGrammarError
from spec_grammar.protocol import (
    Capabilities,
    CompiledGrammar,
    GrammarBackend,
    SpecGrammar,
    TokenizerInfo,
)
from spec_grammar.specs import GrammarSpec, JsonSchema, Regex
from spec_grammar.tree import DraftTree

try:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema
except ImportError as e:  # pragma: no cover - exercised when the extra is missing
    raise ImportError("the outlines backend needs `pip install outlines-core`") from e

__all__ = ["OutlinesBackend", "OutlinesMatcher", "OutlinesGrammar", "DEFAULT_MASK_CACHE_BYTES"]

DEFAULT_MASK_CACHE_BYTES = 32 << 20
"""Per compiled grammar: bytes of packed mask rows kept (SmolLM2: ~5,400 DFA states; a
262k-token vocabulary: 1,024 states)."""

_TERMINATED = -1  # state-list sentinel after an accepted stop token (DFA states are u32)
_MAX_FORCED = 64  # same bound as spec_grammar.traverse.forced_tokens_by_mask

# JsonSchema.whitespace -> outlines' whitespace_pattern (None = outlines' default, `[ ]?`).
_WHITESPACE = {"compact": "", "spaced": r"[ ]?", "flexible": None}


def build_vocabulary(info: TokenizerInfo) -> "oc.Vocabulary":
    """``outlines_core.Vocabulary(eos, {token_bytes: [ids]})`` for a tokenizer.

    The map's keys are the tokens' raw bytes (byte-level BPE and SentencePiece pieces decoded
    by :mod:`spec_grammar.vocab`). Left out: stop tokens (outlines refuses the EOS in the map;
    the adapter allows stop tokens itself at final states), special/added tokens (a grammar
    never produces them) and tokens with no bytes. The Vocabulary's EOS is the first stop
    token; the Index then adds it at final states, and the adapter strips it from the masks.
    """
    excluded = set(info.special_token_ids) | set(info.stop_token_ids)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(info.token_bytes):
        if b and i not in excluded:
            by_bytes.setdefault(b, []).append(i)
    return oc.Vocabulary(info.stop_token_ids[0], by_bytes)


class OutlinesGrammar:
    """A compiled grammar: the outlines ``Index`` plus an LRU of packed mask rows per DFA state.

    ``row(state)`` is the ``(ceil(V/32),)`` int32 row of tokens allowed in ``state`` (read-only;
    stop tokens set exactly when the state is final; special, padding and EOS-as-text ids never
    set). ``forced(state)`` is the one non-stop token allowed in a non-final state, else -1.
    The cache holds at most ``max_cached_states`` rows and is thread-safe.

    Args:
        index: the outlines-core Index.
        info: the tokenizer info the vocabulary was built from.
        cache_bytes: bytes of packed rows to keep (at least one row is always kept).
    """

    def __init__(self, index: "oc.Index", info: TokenizerInfo, cache_bytes: int):
        self.index = index
        self.initial_state: int = index.get_initial_state()
        self._width = info.bitmask_width
        self._eos = info.stop_token_ids[0]
        self._stop_ids = np.array(sorted(set(info.stop_token_ids)), dtype=np.int64)
        self.max_cached_states = max(1, int(cache_bytes) // (4 * self._width))
        self._rows: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.row_builds = 0

    @property
    def num_cached_states(self) -> int:
        return len(self._rows)

    def entry(self, state: int) -> tuple[np.ndarray, int]:
        """``(row, forced)`` of ``state``, from the cache or built (and cached)."""
        with self._lock:
            hit = self._rows.get(state)
            if hit is not None:
                self._rows.move_to_end(state)
                return hit
        built = self._build(state)
        with self._lock:
            self._rows[state] = built
            self._rows.move_to_end(state)
            while len(self._rows) > self.max_cached_states:
                self._rows.popitem(last=False)
            self.row_builds += 1
        return built

    def row(self, state: int) -> np.ndarray:
        return self.entry(state)[0]

    def forced(self, state: int) -> int:
        return self.entry(state)[1]

    def _build(self, state: int) -> tuple[np.ndarray, int]:
        allowed = self.index.get_allowed_tokens(state)
        ids = np.fromiter(allowed, dtype=np.int64, count=len(allowed))
        ids = ids[ids != self._eos]  # the Index's own EOS self-loop; stops are set below
        final = self.index.is_final_state(state)
        dense = np.zeros(self._width * 32, dtype=bool)
        dense[ids] = True
        if final:
            dense[self._stop_ids] = True
        row = np.packbits(dense, bitorder="little").view("<i4").astype(np.int32)
        row.flags.writeable = False
        forced = int(ids[0]) if len(ids) == 1 and not final else -1
        return row, forced


class OutlinesMatcher(SpecGrammar):
    """:class:`SpecGrammar` over an outlines-core ``Index``, tracking the integer DFA state.

    State: the list of DFA states after each accepted token (``_TERMINATED`` after a stop
    token), trimmed to the last ``max_rollback_tokens + 1`` entries, so rollback, fork and
    termination are exact and O(1) / O(max_rollback_tokens).
    """

    def __init__(self, backend: "OutlinesBackend", grammar: OutlinesGrammar, states: list[int] | None = None):
        super().__init__(backend.tokenizer_info, max_rollback_tokens=backend.max_rollback_tokens)
        self._backend = backend
        self._g = grammar
        self._index = grammar.index
        self._states = [grammar.initial_state] if states is None else states
        self._keep = self._max_rollback_tokens + 1

    def _push(self, state: int) -> None:
        states = self._states
        states.append(state)
        if len(states) > 2 * self._keep:  # amortized O(1) trim of history nobody can roll back to
            del states[: -self._keep]

    def _step(self, state: int, token: int) -> int | None:
        """The state after ``token`` (``_TERMINATED`` for an accepted stop token) or None."""
        if token in self._stop_ids:
            return _TERMINATED if self._index.is_final_state(state) else None
        return self._index.get_next_state(state, token)

    def _accept_token(self, token: int) -> bool:
        nxt = self._step(self._states[-1], token)
        if nxt is None:
            return False
        self._push(nxt)
        return True

    def _accept_tokens(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            state = self._states[-1]
            if state == _TERMINATED:
                break
            nxt = self._step(state, t)
            if nxt is None:
                break
            self._push(nxt)
            n += 1
        return n

    def _validate_tokens(self, tokens: list[int]) -> int:
        state = self._states[-1]
        n = 0
        for t in tokens:
            if state == _TERMINATED:
                break
            state = self._step(state, t)
            if state is None:
                break
            n += 1
        return n

    def _rollback(self, num_tokens: int) -> None:
        del self._states[-num_tokens:]

    def _fork(self) -> "OutlinesMatcher":
        return OutlinesMatcher(self._backend, self._g, list(self._states))

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask.numpy()[row] = self._g.row(self._states[-1])

    def _is_terminated(self) -> bool:
        return self._states[-1] == _TERMINATED

    def _forced_tokens(self) -> list[int]:
        # A final state is never forced: the stop token is an alternative there.
        state = self._states[-1]
        forced: list[int] = []
        while len(forced) < _MAX_FORCED:
            t = self._g.forced(state)
            if t < 0:
                break
            forced.append(t)
            state = self._index.get_next_state(state, t)
        return forced

    def _fill_tree_bitmask(self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int) -> torch.Tensor:
        # Same rows as spec_grammar.traverse.fill_tree_bitmask_dfs, without touching the
        # matcher: a node's state is get_next_state(parent's state, token), and since
        # parents[i] < i, one pass in index order visits parents first.
        n = tree.num_nodes
        rows = bitmask.numpy()[row_offset : row_offset + n]
        rows[:] = 0
        tokens = tree.token_list
        parents = tree.parent_list
        n_tok = self.info.tokenizer_vocab_size
        g = self._g
        node_state: list[int | None] = [None] * n
        node_state[0] = self._states[-1]
        rows[0] = g.row(node_state[0])
        valid = [False] * n
        valid[0] = True
        for i in range(1, n):
            parent_state = node_state[parents[i]]
            if parent_state is None or parent_state == _TERMINATED:
                continue
            t = tokens[i]
            if not 0 <= t < n_tok:
                continue
            state = self._step(parent_state, t)
            if state is None:
                continue
            valid[i] = True
            node_state[i] = state
            if state != _TERMINATED:
                rows[i] = g.row(state)
        return torch.tensor(valid, dtype=torch.bool)


class OutlinesBackend(GrammarBackend):
    """outlines-core (https://github.com/dottxt-ai/outlines-core) behind the spec-grammar protocol.

    Grammars: ``JsonSchema`` (and ``ToolCalls``) through ``build_regex_from_schema``, and
    ``Regex``. Building the Index walks the whole vocabulary per DFA state: 0.3-0.5 s for a
    JSON schema with SmolLM2, 7-8 s with a 262k vocabulary; it runs inside :meth:`compile`
    (cached).

    Whitespace (``JsonSchema.whitespace``), as outlines inserts one whitespace pattern at every
    place JSON allows whitespace: ``compact`` -> no whitespace; ``spaced`` -> ``[ ]?`` (the
    closest outlines can express: it accepts ``json.dumps`` output but also the compact form and
    single spaces after ``{``/``[`` and before ``:``/``,``/``]``/``}``); ``flexible`` ->
    outlines' default pattern (``[ ]?`` in 0.2.14, so currently the same as ``spaced``).

    Extra option: ``mask_cache_bytes`` (default :data:`DEFAULT_MASK_CACHE_BYTES`), bytes of
    packed mask rows each compiled grammar keeps.
    """

    name = "outlines"
    capabilities = Capabilities(
        json_schema=True,
        regex=True,
        ebnf=False,
        lark=False,
        tool_calls=True,
        native_rollback=False,
        native_fork=False,
        native_validate=False,
        native_tree_fill=False,
        native_forced_tokens=False,
        parallel_fill=False,
        releases_gil=False,
    )

    def __init__(self, tokenizer: Any, *, mask_cache_bytes: int = DEFAULT_MASK_CACHE_BYTES, **kwargs: Any):
        super().__init__(tokenizer, **kwargs)
        self.mask_cache_bytes = int(mask_cache_bytes)
        self._vocabulary = build_vocabulary(self.tokenizer_info)

    @classmethod
    def library_version(cls) -> str:
        return importlib.metadata.version("outlines-core")

    def _regex_of(self, spec: GrammarSpec) -> str:
        if isinstance(spec, Regex):
            return spec.pattern
        if isinstance(spec, JsonSchema):
            if spec.json_schema is False:
                raise GrammarCompileError("the schema `false` accepts no document")
            schema = spec.schema_json() if spec.json_schema is not True else "{}"
            try:
                return build_regex_from_schema(schema, whitespace_pattern=_WHITESPACE[spec.whitespace])
            except ValueError as e:
                # outlines says "Unsupported ..." / "... is not supported by Outlines" for
                # valid schemas it cannot express.
                cls = UnsupportedGrammarError if "support" in str(e).lower() else GrammarCompileError
                raise cls(f"json_schema: {e}", reason=str(e)) from e
        raise UnsupportedGrammarError(f"{spec.kind} is not supported by outlines-core (regex only)")

    def _compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        index = oc.Index(self._regex_of(spec), self._vocabulary)
        return OutlinesGrammar(index, self.tokenizer_info, self.mask_cache_bytes)

    def _matcher(self, compiled: CompiledGrammar) -> OutlinesMatcher:
        return OutlinesMatcher(self, compiled.native)
