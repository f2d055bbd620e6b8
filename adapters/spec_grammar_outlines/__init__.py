r"""outlines-core adapter for spec-grammar.

outlines-core 0.2.14 compiles a regex (JSON Schema through ``build_regex_from_schema``) into an
``Index``: a token-level DFA over the vocabulary. Its ``Guide`` is not used: copying one pickles
the whole Index (60 ms .. 1.3 s), its rollback is a ring of 32 states, ``reset()`` keeps that
history and ``advance(EOS)`` raises even in a final state (outlines-core issue #227). Instead
the matcher tracks the integer DFA state itself (``Index.get_next_state``) and keeps the chain
of past states, so every protocol operation is emulated cheaply:

- rollback(k): k steps up a chain of past states; fork: the same chain (O(1), entries are
  immutable and shared; each matcher keeps at most ``2 * (max_rollback_tokens + 1)``);
- termination: a stop token accepted where the grammar can end;
- masks: ``Index.get_allowed_tokens(state)`` packed into the protocol's int32 layout once per
  DFA state and kept in a bounded LRU on the compiled grammar (tree walks revisit the same
  states constantly), so a fill is a row copy;
- tree fill, validation and forced tokens: loops over integer states, no matcher mutation.

No context-free grammars: ``Ebnf`` and ``Lark`` raise ``UnsupportedGrammarError`` at compile.

**Library fault worked around (outlines-core 0.2.14, ``Index::new``).** regex-automata DFAs
report a match one byte late, and the Index keeps a token only when the state after it is "not a
match" or "a full match at end of input". A token whose text *before its last byte* completes a
match but whose full text does not is therefore dropped: with ``a( b)?`` the token ``" "`` is
not allowed after ``a``, with ``[0-9]+(\.[0-9]+)?`` the token ``"."`` is not allowed after
``1``. The adapter compiles ``(?:R)`` followed by a sentinel character (:data:`SENTINEL`, added
to the vocabulary under an id no model produces) instead of ``R``: no real text completes a
match any more, so no real token is dropped, and "R can end here" becomes "the sentinel token
leads to a final state". Real byte tokens can spell the sentinel's UTF-8 bytes; the states
only that spelling reaches (continuations are nothing but the rest of the sentinel) are
detected and refused (:meth:`OutlinesGrammar.next_state`). A pattern that can match the
sentinel's code point itself is still correct, unless it accepts *only* the sentinel's
trailing bytes at some point (then that branch is refused, failing closed).
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from spec_grammar.compile import LibraryResult
from spec_grammar.errors import GrammarCompileError, GrammarLimitError, UnsupportedGrammarError
from spec_grammar.json_schema.rewrite import (
    const_within_enum,
    enum_within_type,
    map_subschemas,
    ref_siblings_dropped,
    rewrite_patterns,
)
from spec_grammar.json_schema.strict import (
    NOT_CONTEXT_FREE_KEYWORDS,
    REMOTE_REF,
    REQUIRED_UNDECLARED,
    KeywordSupport,
)
from spec_grammar.limits import json_nesting_depth, regex_positions, regex_repeat_nesting
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

__all__ = [
    "OutlinesBackend",
    "OutlinesMatcher",
    "OutlinesGrammar",
    "VocabularyInfo",
    "SENTINEL",
    "DEFAULT_MASK_CACHE_BYTES",
    "DEFAULT_MAX_INDEX_BYTES",
    "DEFAULT_MAX_INDEX_STATES",
    "estimated_index_bytes",
]

DEFAULT_COMPILE_CACHE_SIZE = 16
"""Compiled grammars kept by default (the protocol keeps 256): an outlines index can be large."""

DEFAULT_MAX_INDEX_BYTES = 1 << 30
"""Default of ``max_index_bytes``: the largest estimated index a compile may build (1 GiB)."""

DEFAULT_MAX_INDEX_STATES = 50_000
"""Default of ``max_index_states``: the most automaton states (positions of the unrolled
pattern) a compile may build; each costs a walk of the vocabulary (1-4 ms with SmolLM2 on a
busy 2-core host: ``a{20000}`` took 72 s), and a build past ``compile_timeout_s`` still runs
to its end in its thread."""

DEFAULT_MAX_REGEX_BYTES = 4 << 20
"""Default of ``max_regex_bytes``: the longest regex (in UTF-8 bytes) whose size is estimated
at all. Measuring takes Python's regex parser over the whole pattern: the 8.7 MB regex of an
object of 500 optional properties took 34 s of a loaded host before any library work (the
longest of the JSONSchemaBench sample's regexes is 0.8 MB)."""

INDEX_BYTES_PER_ENTRY = 12
"""Bytes the outlines-core 0.2.14 index spends per (state, allowed token) transition, measured
with SmolLM2 (arrays of length-bounded strings: 97-300 MB for 200-500 wide positions, 0.5-0.6
MB per wide state at 49,152 tokens)."""

NESTED_BYTES_PER_PAIR = 250
"""Bytes per (state, wide state) pair an outlines-core 0.2.14 build of nested counted
repetitions takes (fit to arrays of <= 3 items nested 4 and 5 deep, SmolLM2: 42 and 334 MB;
the 248 regexes of the bundled corpora have no such nesting, so the term refuses none)."""

DEFAULT_MASK_CACHE_BYTES = 32 << 20
"""Per compiled grammar: bytes of packed mask rows kept (SmolLM2: ~5,400 DFA states; a
262k-token vocabulary: 1,024 states)."""

SENTINEL = "\U0010fffd"
"""End marker appended to every compiled pattern (a private-use code point; no tokenizer
we know has a token containing all of its UTF-8 bytes, which the backend checks)."""
_SENTINEL_BYTES = SENTINEL.encode("utf-8")

_TERMINATED = -1  # state-list sentinel after an accepted stop token (DFA states are u32)

_STRING_CHAR = r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
"""outlines-core 0.2.14's regex for one character of a JSON string: it leaves out U+007F..U+009F
(JSON allows them raw) and every ``\\uXXXX`` escape, so a string holding a control character
other than \\b \\f \\n \\r \\t could not be written at all (JSON has no other spelling)."""

_JSON_STRING_CHAR = r'([^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])'
"""One character of a JSON string: any character but ``"``, ``\\`` and U+0000..U+001F raw, a
short escape, or ``\\u00XX`` for a control character (the only spelling JSON has for most of
them). Other ``\\uXXXX`` spellings of characters that can be written raw are left out: they add
states to every string position of the index (a length-bounded string repeats them) for no
value that could not be written otherwise."""

_PATTERN_WHY = (
    "is not enforced: outlines-core 0.2.14 writes the pattern into its regex as it stands, "
    "and this construct has no translation (the pattern is left out)"
)

_DIGIT_RUNS = (r"[1-9][0-9]*", r"\.[0-9]+", r"[eE][+-][0-9]+")
"""The unbounded digit runs of outlines-core 0.2.14's INTEGER and NUMBER regexes (integer part,
fraction, exponent), rewritten for ``max_digits`` by :func:`_bounded_digits`."""


def _bounded_digits(regex: str, digits: int | None) -> str:
    r"""``regex`` (outlines' schema regex) with each number's digit runs at most ``digits``
    long: ``[1-9][0-9]{0,d-1}``, ``\.[0-9]{1,d}``, ``[eE][+-][0-9]{1,d}``. The same text in a
    translated ``pattern`` is bounded too (strings the limit then refuses are a subset)."""
    if digits is None:
        return regex
    integer, fraction, exponent = _DIGIT_RUNS
    return (
        regex.replace(integer, f"[1-9][0-9]{{0,{digits - 1}}}")
        .replace(fraction, f"\\.[0-9]{{1,{digits}}}")
        .replace(exponent, f"[eE][+-][0-9]{{1,{digits}}}")
    )


def _digits_for(schema: Any, digits: int | None) -> tuple[int | None, list[str]]:
    """The digit bound :func:`_bounded_digits` may apply to ``schema``: ``digits``, raised to
    the integer digits of the largest numeric bound the schema sets (one bound applies to
    every number of the regex, and outlines ignores numeric bounds: a ``minimum: 100000``
    must stay satisfiable), with a warning line where it was raised."""
    if digits is None:
        return None, []
    need: list[tuple[int, str]] = []

    def node(n: dict[str, Any], where: str) -> dict[str, Any]:
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = n.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300:
                need.append((len(str(int(abs(v)) + 1)), where or "/"))
        return n

    map_subschemas(schema, node)
    wider = [(d, at) for d, at in need if d > digits]
    if not wider:
        return digits, []
    top, at = max(wider)
    return top, [
        f"max_digits at {at}: outlines-core 0.2.14 bounds every number of the schema alike, "
        f"so max_digits={digits} is raised to {top} to keep this numeric bound satisfiable"
    ]


# JsonSchema.whitespace -> outlines' whitespace_pattern (None = outlines' default, `[ ]?`).
_WHITESPACE = {"compact": "", "spaced": r"[ ]?", "flexible": None}


def _for_outlines(schema: Any) -> Any:
    """``schema`` made safe for outlines-core 0.2.14's schema-to-regex, which writes property
    names into the pattern without JSON-escaping them (``a"b`` gave the output ``{"a"b": 1}``):
    names needing an escape are written pre-escaped, in ``properties`` and ``required``; ``enum``
    values outside a node's ``type`` are dropped (:func:`enum_within_type`).

    Raises :class:`UnsupportedGrammarError` (naming the JSON pointer) where the library would
    emit text that is not JSON: ``allOf`` with several branches (their patterns are
    concatenated: ``{"a": 1}{"b": "x"}``) and a subschema ``enum: []`` (an empty pattern:
    ``{"e": }``)."""
    # two walks: the checks name pointers with the names as written, before they are escaped
    schema = ref_siblings_dropped(schema)
    return map_subschemas(map_subschemas(schema, _checked_node), _escaped_names)


def _integral_literal(v: Any) -> bool:
    return isinstance(v, float) and v == v and abs(v) != float("inf") and v == int(v)


def _integral_literals(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with each integral float of ``const`` / ``enum`` (``-2.0``) listed with its
    integer spelling too: outlines-core writes literals as ``json.dumps`` does, so ``-2`` (the
    same JSON-Schema value) was refused."""
    values = [node["const"]] if "const" in node else node.get("enum")
    if not isinstance(values, list) or not any(_integral_literal(v) for v in values):
        return node
    out = {k: v for k, v in node.items() if k not in ("const", "enum")}
    listed = []
    for v in values:
        listed += [int(v), v] if _integral_literal(v) else [v]
    out["enum"] = listed
    return out


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _checked_node(node: dict[str, Any], where: str) -> dict[str, Any]:
    # before the checks: a narrowed enum can be empty
    node = enum_within_type(const_within_enum(node))
    node = _integral_literals(node)
    counts = [k for k in _COUNTS if isinstance(node.get(k), float) and node[k] == int(node[k])]
    if counts:  # outlines ignores a count written as a float (2.0): the same bound as an int
        node = {**node, **{k: int(node[k]) for k in counts}}
    if isinstance(node.get("pattern"), str) and ("minLength" in node or "maxLength" in node):
        # outlines writes the length bound and drops the pattern: keep the pattern (declared)
        node = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    at = where or "/"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise UnsupportedGrammarError(
            f"allOf with {len(node['allOf'])} branches at {at}: outlines-core 0.2.14 concatenates the "
            "branches' patterns (the output would not be JSON); merge them into one schema"
        )
    if where and node.get("enum") == []:
        raise UnsupportedGrammarError(
            f"enum: [] at {at}: outlines-core 0.2.14 turns a subschema that accepts nothing into an empty "
            "pattern (the output would not be JSON)"
        )
    return node


NATIVE_TEXT_DEPTH = 127
"""The deepest JSON schema text outlines-core 0.2.14 reads (serde_json's limit: an array of
objects nested 127 deep compiles, 128 deep is "Expected a valid JSON string.")."""

_MAX_RECURSION_DEPTH = 3
"""outlines-core 0.2.14's ``build_regex_from_schema(max_recursion_depth=3)``: a regex has no
recursion, so a recursive reference is unrolled this many levels and refused below."""


def _refusals(schema: Any) -> list[str]:
    """What outlines-core 0.2.14 refuses that the schema allows, one line per use (as
    :func:`~spec_grammar.json_schema.strict.unenforced_keywords` writes them, tag ``refuses``):
    objects with ``properties`` get no other property (``additionalProperties`` other than
    ``false`` is ignored there), and recursive references stop after
    :data:`_MAX_RECURSION_DEPTH` levels."""
    notes: list[str] = []
    refs: list[tuple[str, str]] = []

    def node(n: dict[str, Any], where: str) -> dict[str, Any]:
        if isinstance(n.get("pattern"), str):
            for k in ("minLength", "maxLength"):
                if k in n:
                    notes.append(
                        f"{k} at {where or '/'}: outlines-core 0.2.14 keeps the length bound and drops "
                        "the pattern next to it; the adapter keeps the pattern and leaves the bound out"
                    )
        if isinstance(n.get("properties"), dict) and n["properties"]:
            if n.get("additionalProperties", True) is not False:
                notes.append(
                    f"additionalProperties:refuses at {where or '/'}: outlines-core 0.2.14 writes "
                    "the declared properties only, other property names are refused"
                )
        ref = n.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            refs.append((where, ref[1:]))
        return n

    map_subschemas(schema, node)
    recursive = _on_cycles(refs)
    for where, t in refs:
        if t in recursive:
            at = where or "/"
            notes.append(
                f"$ref:refuses at {at}: outlines-core 0.2.14 unrolls a recursive reference "
                f"{_MAX_RECURSION_DEPTH} levels deep, deeper documents are refused"
            )
            notes.append(
                f"$ref at {at}: outlines-core 0.2.14 writes an empty object where the unrolled "
                "reference stops (`{}` is accepted there whatever the referenced schema says)"
            )
    return list(dict.fromkeys(notes))


def _on_cycles(refs: list[tuple[str, str]]) -> set[str]:
    """The targets of ``refs`` (``(where the $ref is, the pointer it names)``, both JSON
    pointers) that lead back to themselves: a target leads to every target referred to from
    inside it. Tarjan's strongly connected components over an explicit stack: linear in the
    references and the lengths of their pointers (a chain of 5,000 references took seconds
    with one search per reference)."""
    targets = {t for _, t in refs}
    edges: dict[str, list[str]] = {t: [] for t in targets}
    for where, t in refs:
        # the targets holding ``where``: the root and ``where``'s own prefixes
        ends = [0] + [i for i, ch in enumerate(where) if ch == "/" and i] + [len(where)]
        for holder in dict.fromkeys(where[:i] for i in ends):
            if holder in edges:
                edges[holder].append(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    placed: set[str] = set()
    found: set[str] = set()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        on_stack.append(root)
        placed.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    on_stack.append(w)
                    placed.add(w)
                    work.append((w, iter(edges[w])))
                elif w in placed:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    x = on_stack.pop()
                    placed.discard(x)
                    component.append(x)
                    if x == v:
                        break
                if len(component) > 1 or v in edges[v]:
                    found.update(component)
    return found


def _escaped_names(node: dict[str, Any], _where: str) -> dict[str, Any]:
    def esc(name: Any) -> Any:
        return json.dumps(name, ensure_ascii=False)[1:-1] if isinstance(name, str) else name

    out = dict(node)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {esc(n): sub for n, sub in out["properties"].items()}
    if isinstance(out.get("required"), list):
        out["required"] = [esc(n) for n in out["required"]]
    return node if out == node else out


def estimated_index_bytes(regex: str, vocab_size: int) -> int | None:
    """Bytes outlines-core 0.2.14's ``Index`` of ``regex`` would take, estimated before it is
    built: its automaton has a state per position of the unrolled pattern, and a state inside
    a wide character set (a JSON string's characters, ``.``) keeps a transition for nearly
    every token of the vocabulary (:func:`spec_grammar.limits.regex_positions` with
    ``wide_only``), at :data:`INDEX_BYTES_PER_ENTRY` bytes each; narrow states (digits,
    literals) are left out. Measured against real builds (SmolLM2): 236 MB estimated / 218 MB
    used for ten strings of <= 40 characters, 295 / 300 MB for five of <= 100.

    Where counted repetitions nest (:func:`spec_grammar.limits.regex_repeat_nesting` >= 2:
    arrays with ``maxItems`` inside arrays with ``maxItems``) the build grows instead with
    states x wide states, :data:`NESTED_BYTES_PER_PAIR` bytes each: arrays of <= 3 items nested
    4 and 5 deep around ``{"a": string}`` took 42 and 334 MB (estimated 41 and 369), 6 deep
    several GB, then the process aborted. None when the pattern cannot be read (no
    estimate)."""
    wide = regex_positions(regex, wide_only=True)
    if wide is None:
        return None
    estimate = wide * vocab_size * INDEX_BYTES_PER_ENTRY
    if (regex_repeat_nesting(regex) or 0) >= 2:
        states = regex_positions(regex) or 0
        estimate = max(estimate, states * wide * NESTED_BYTES_PER_PAIR)
    return estimate


class VocabularyInfo:
    """The outlines ``Vocabulary`` of a tokenizer plus what the sentinel workaround needs.

    Attributes:
        vocabulary: ``outlines_core.Vocabulary(eos, {token_bytes: [ids]})``. Keys are the
            tokens' raw bytes (:mod:`spec_grammar.vocab`). Left out: stop tokens (outlines
            refuses the EOS in the map; the adapter allows stop tokens itself where the grammar
            can end), special/added tokens (a grammar never produces them) and empty tokens.
            The Vocabulary's EOS is the first stop token. The sentinel is added under
            ``sentinel_id`` (= the logits width, an id no model samples).
        sentinel_id: token id of :data:`SENTINEL` in the vocabulary.
        spelled: real token id -> how many sentinel bytes the sentinel would have consumed
            after it if its bytes spell part of the sentinel (ends with a prefix of it, or is a
            piece of its tail); such transitions are checked before use.
        token_bytes: ``token_bytes[i]`` of the tokenizer.

    Raises :class:`GrammarCompileError` if a token holds the whole sentinel.
    """

    def __init__(self, info: TokenizerInfo):
        excluded = set(info.special_token_ids) | set(info.stop_token_ids)
        sb = _SENTINEL_BYTES
        by_bytes: dict[bytes, list[int]] = {}
        spelled: dict[int, tuple[int, ...]] = {}
        for i, b in enumerate(info.token_bytes):
            if not b or i in excluded:
                continue
            if sb in b:
                raise GrammarCompileError(f"token {i} contains the sentinel {SENTINEL!r}")
            if b[-1] in sb:  # cheap filter: every spelling piece ends with a sentinel byte
                ks = {k for k in range(1, len(sb)) if b.endswith(sb[:k])}
                ks |= {j + len(b) for j in range(1, len(sb)) if sb[j:].startswith(b)}
                if ks:
                    spelled[i] = tuple(sorted(ks))
            by_bytes.setdefault(b, []).append(i)
        self.sentinel_id = info.vocab_size
        self.vocabulary = oc.Vocabulary(info.stop_token_ids[0], by_bytes)
        self.vocabulary.insert(sb, self.sentinel_id)
        self.spelled = spelled
        self.token_bytes = info.token_bytes


class OutlinesGrammar:
    """A compiled grammar: the outlines ``Index`` of ``(?:R)`` + :data:`SENTINEL`, the sentinel
    bookkeeping, and an LRU of packed mask rows per DFA state.

    ``next_state(state, t)``: the state after real token ``t`` or None. ``is_final(state)``: R
    can end here. ``row(state)``: the ``(ceil(V/32),)`` int32 row of tokens allowed in
    ``state`` (read-only; stop tokens set exactly when final; special, padding and sentinel ids
    never set). ``forced(state)``: the one token allowed in a non-final state, else -1. The row
    cache holds at most ``max_cached_states`` rows and is thread-safe.

    Args:
        index: the outlines-core Index of the sentinel-terminated pattern.
        info: the tokenizer info.
        vocab: the :class:`VocabularyInfo` the Index was built with.
        cache_bytes: bytes of packed rows to keep (at least one row is always kept).
    """

    def __init__(
        self, index: oc.Index, info: TokenizerInfo, vocab: VocabularyInfo, cache_bytes: int
    ):
        self.index = index
        self.initial_state: int = index.get_initial_state()
        self._width = info.bitmask_width
        self._n_tok = info.tokenizer_vocab_size
        self._eos = info.stop_token_ids[0]
        self._stop_ids = np.array(sorted(set(info.stop_token_ids)), dtype=np.int64)
        self._sentinel = vocab.sentinel_id
        self._spelled = vocab.spelled
        self._spelled_ids = np.array(sorted(vocab.spelled), dtype=np.int64)
        self._token_bytes = vocab.token_bytes
        self._spelling_only: dict[tuple[int, int], bool] = {}
        self.max_cached_states = max(1, int(cache_bytes) // (4 * self._width))
        self._rows: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.row_builds = 0

    @property
    def num_cached_states(self) -> int:
        return len(self._rows)

    # -- transitions --------------------------------------------------------------------------
    def is_final(self, state: int) -> bool:
        nxt = self.index.get_next_state(state, self._sentinel)
        return nxt is not None and self.index.is_final_state(nxt)

    def next_state(self, state: int, token: int) -> int | None:
        nxt = self.index.get_next_state(state, token)
        if nxt is None or token not in self._spelled:
            return nxt
        if any(self._spelling_only_state(nxt, k) for k in self._spelled[token]):
            return None
        return nxt

    def _real_tokens(self, state: int) -> np.ndarray:
        allowed = self.index.get_allowed_tokens(state)
        ids = np.fromiter(allowed, dtype=np.int64, count=len(allowed))
        # The Index's own EOS self-loop and the sentinel are not real choices here.
        return ids[(ids < self._n_tok) & (ids != self._eos)]

    def _spelling_only_state(self, state: int, k: int) -> bool:
        """True when ``state`` is explained by nothing but real tokens spelling the first ``k``
        sentinel bytes: R cannot end here and every continuation is the rest of the sentinel,
        followed (recursively) by such states. Memoized; at most 4 levels deep."""
        key = (state, k)
        hit = self._spelling_only.get(key)
        if hit is not None:
            return hit
        result = not self.is_final(state)
        if result:
            rest = _SENTINEL_BYTES[k:]
            for t in self._real_tokens(state).tolist():
                b = self._token_bytes[t]
                if not rest.startswith(b) or not self._spelling_only_state(
                    self.index.get_next_state(state, t), k + len(b)
                ):
                    result = False
                    break
        self._spelling_only[key] = result
        return result

    # -- masks --------------------------------------------------------------------------------
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
        ids = self._real_tokens(state)
        if len(self._spelled_ids):
            odd = ids[np.isin(ids, self._spelled_ids)]
            if len(odd):
                refused = [t for t in odd.tolist() if self.next_state(state, t) is None]
                ids = ids[~np.isin(ids, refused)]
        final = self.is_final(state)
        dense = np.zeros(self._width * 32, dtype=bool)
        dense[ids] = True
        if final:
            dense[self._stop_ids] = True
        row = np.packbits(dense, bitorder="little").view("<i4").astype(np.int32)
        row.flags.writeable = False
        forced = int(ids[0]) if len(ids) == 1 and not final else -1
        return row, forced


class _StateNode:
    """One entry of a matcher's state history: the DFA state after a token, the entry before it
    (None at the start of the chain) and how many entries the chain holds down to here.
    Entries are never changed, so a matcher and its forks share them."""

    __slots__ = ("parent", "state", "height")

    def __init__(self, parent: _StateNode | None, state: int):
        self.parent = parent
        self.state = state
        self.height = 1 if parent is None else parent.height + 1


class OutlinesMatcher(SpecGrammar):
    """:class:`SpecGrammar` over an outlines-core ``Index``, tracking the integer DFA state.

    State: the DFA states after each accepted token (``_TERMINATED`` after a stop token) as a
    chain of immutable :class:`_StateNode` entries that forks share: ``fork`` is O(1) and
    rollback O(k). A matcher's chain is cut to its last ``max_rollback_tokens + 1`` entries
    (copied into a new chain, amortized O(1) per token) once it holds twice that, so the
    history a matcher keeps alive is bounded whatever the output's length.
    """

    def __init__(
        self, backend: OutlinesBackend, grammar: OutlinesGrammar, top: _StateNode | None = None
    ):
        super().__init__(backend.tokenizer_info, max_rollback_tokens=backend.max_rollback_tokens)
        self._backend = backend
        self._g = grammar
        self._top = _StateNode(None, grammar.initial_state) if top is None else top
        self._keep = self._max_rollback_tokens + 1

    @property
    def history_length(self) -> int:
        """Entries of the state history this matcher keeps alive (at most
        ``2 * (max_rollback_tokens + 1)``)."""
        return self._top.height

    def _push(self, state: int) -> None:
        top = _StateNode(self._top, state)
        if top.height > 2 * self._keep:  # cut what nobody can roll back to any more
            states = []
            node: _StateNode | None = top
            for _ in range(self._keep):
                states.append(node.state)  # type: ignore[union-attr]
                node = node.parent  # type: ignore[union-attr]
            top = None
            for st in reversed(states):
                top = _StateNode(top, st)
        self._top = top  # type: ignore[assignment]

    def _step(self, state: int, token: int) -> int | None:
        """The state after ``token`` (``_TERMINATED`` for an accepted stop token) or None."""
        if token in self._stop_ids:
            return _TERMINATED if self._g.is_final(state) else None
        return self._g.next_state(state, token)

    def _accept_token(self, token: int) -> bool:
        nxt = self._step(self._top.state, token)
        if nxt is None:
            return False
        self._push(nxt)
        return True

    def _accept_tokens(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            state = self._top.state
            if state == _TERMINATED:
                break
            nxt = self._step(state, t)
            if nxt is None:
                break
            self._push(nxt)
            n += 1
        return n

    def _validate_tokens(self, tokens: list[int]) -> int:
        state = self._top.state
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
        top = self._top
        for _ in range(num_tokens):
            top = top.parent  # type: ignore[assignment]
        self._top = top

    def _fork(self) -> OutlinesMatcher:
        return OutlinesMatcher(self._backend, self._g, self._top)

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask.numpy()[row] = self._g.row(self._top.state)

    def _is_terminated(self) -> bool:
        return self._top.state == _TERMINATED

    def _forced_tokens(self) -> list[int]:
        # A final state is never forced: the stop token is an alternative there.
        state = self._top.state
        forced: list[int] = []
        while len(forced) < self.max_forced_tokens:
            t = self._g.forced(state)
            if t < 0:
                break
            forced.append(t)
            state = self._g.next_state(state, t)
        return forced

    def _fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        # Same rows as spec_grammar.traverse.fill_tree_bitmask_dfs, without touching the
        # matcher: a node's DFA state is the step from its parent's state by its token, and
        # since parents[i] < i, one pass in index order visits parents first.
        n = tree.num_nodes
        rows = bitmask.numpy()[row_offset : row_offset + n]
        rows[:] = 0
        tokens = tree.token_list
        parents = tree.parent_list
        n_tok = self.info.tokenizer_vocab_size
        g = self._g
        node_state: list[int | None] = [None] * n
        node_state[0] = self._top.state
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
    ``Regex``. Building the Index walks the whole vocabulary per DFA state (0.2-0.5 s for a
    JSON schema with SmolLM2, 5-8 s with Gemma-3's 262k vocabulary); it runs inside
    :meth:`compile` (cached). The first mask of a DFA state costs ~1 ms (SmolLM2) to ~20 ms
    (Gemma-3) in free-text states, later ones are a row copy.

    Whitespace (``JsonSchema.whitespace``), as outlines inserts one whitespace pattern at every
    place JSON allows whitespace: ``compact`` -> no whitespace; ``spaced`` -> ``[ ]?`` (the
    closest outlines can express: it accepts ``json.dumps`` output but also the compact form and
    single spaces after ``{``/``[`` and before ``:``/``,``/``]``/``}``); ``flexible`` ->
    outlines' default pattern (``[ ]?`` in 0.2.14, so currently the same as ``spaced``).

    Extra options: ``mask_cache_bytes`` (default :data:`DEFAULT_MASK_CACHE_BYTES`), bytes of
    packed mask rows each compiled grammar keeps; ``max_index_bytes`` (default
    :data:`DEFAULT_MAX_INDEX_BYTES`, None = no limit): a spec whose index is estimated larger
    (:func:`estimated_index_bytes`) is refused with :class:`GrammarLimitError` before the
    index is built (the build cannot be interrupted: an array of 50 strings of <= 200
    characters took 6.3 GB and 38 s); ``max_index_states`` (default
    :data:`DEFAULT_MAX_INDEX_STATES`, None = no limit): the same for the automaton's estimated
    states (:func:`spec_grammar.limits.regex_positions`), which bound the build's time;
    ``max_regex_bytes`` (default :data:`DEFAULT_MAX_REGEX_BYTES`, None = no limit): a spec
    whose regex is longer is refused before it is measured.
    """

    name = "outlines"
    # building the Index cannot be interrupted and a failed allocation in it aborts the
    # process (SIGABRT): compiles run in a compile process (benchmarks/bench_compile_isolation.py)
    compile_isolation = "process"
    library_requirement = "outlines-core>=0.2.14"  # the oldest release tested (the extra's pin)
    capabilities = Capabilities(
        json_schema=True,
        regex=True,
        ebnf=False,
        lark=False,
        tool_calls=True,
    )
    # max_digits: the number regex's digit runs bounded (_bounded_digits); max_whitespace:
    # every policy writes at most one space here (outlines' `[ ]?`), within any limit >= 1
    output_limits = frozenset({"max_whitespace", "max_digits"})
    # maxLength / maxItems caps unroll into the index, one copy of the value's states per
    # position: a 256-character cap took one string schema from 0.3 s to 41 s, 16 tool calls a
    # BFCL list from 1.6 s to 23 s (SmolLM2, 2 loaded cores); left out, declared per compile.
    # closed_objects: outlines writes declared properties only anyway.
    schema_caps = frozenset({"closed_objects"})
    # Measured on the JSON-Schema-Test-Suite (tests/test_reliability_strict.py).
    json_schema_support = KeywordSupport(
        unenforced={
            **dict.fromkeys(
                NOT_CONTEXT_FREE_KEYWORDS,
                "not translated by outlines-core 0.2.14's schema-to-regex (ignored)",
            ),
            **dict.fromkeys(
                ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
                "outlines-core 0.2.14 ignores numeric bounds (integers and numbers)",
            ),
            "uniqueItems": "outlines-core 0.2.14 ignores uniqueItems (not regular)",
            "multipleOf": "outlines-core 0.2.14 ignores multipleOf",
            "allOf": "outlines-core 0.2.14 supports a single allOf branch only",
            "oneOf": "outlines-core 0.2.14 translates oneOf as an alternation (anyOf)",
            "patternProperties": "outlines-core 0.2.14 ignores patternProperties",
            "minProperties": "outlines-core 0.2.14 ignores minProperties",
            "maxProperties": "outlines-core 0.2.14 ignores maxProperties",
            REQUIRED_UNDECLARED: "outlines-core 0.2.14 ignores required names that properties does not define",
            REMOTE_REF: "outlines-core 0.2.14 resolves only local '#/...' references",
        },
        restricted={
            "format": (
                "outlines-core 0.2.14 asserts the formats it knows, where Draft 2020-12 makes `format` an "
                "annotation: strings off the format are refused"
            )
        },
    )

    def __init__(
        self,
        tokenizer: Any,
        *,
        mask_cache_bytes: int = DEFAULT_MASK_CACHE_BYTES,
        max_index_bytes: int | None = DEFAULT_MAX_INDEX_BYTES,
        max_index_states: int | None = DEFAULT_MAX_INDEX_STATES,
        max_regex_bytes: int | None = DEFAULT_MAX_REGEX_BYTES,
        **kwargs: Any,
    ):
        # an outlines index keeps a transition table per DFA state: hundreds of MB for JSON with an
        # unconstrained value, 6.3 GB for an array of <= 50 strings of <= 200 characters (SmolLM2):
        # 256 of them (the protocol's default) could take the whole host
        kwargs.setdefault("compile_cache_size", DEFAULT_COMPILE_CACHE_SIZE)
        super().__init__(tokenizer, **kwargs)
        self.mask_cache_bytes = int(mask_cache_bytes)
        self.max_index_bytes = None if max_index_bytes is None else int(max_index_bytes)
        self.max_index_states = None if max_index_states is None else int(max_index_states)
        self.max_regex_bytes = None if max_regex_bytes is None else int(max_regex_bytes)
        self._vocab = VocabularyInfo(self.tokenizer_info)

    @classmethod
    def library_version(cls) -> str:
        return importlib.metadata.version("outlines-core")

    def _regex_of(self, spec: GrammarSpec) -> tuple[str, list[str]]:
        """The regex of ``spec`` and the warnings of its rewrites."""
        if isinstance(spec, Regex):
            return spec.pattern, []
        if isinstance(spec, JsonSchema):
            notes: list[str] = []
            digits = spec.limits.max_digits if spec.limits is not None else None
            if spec.json_schema is True:
                schema = "{}"
            else:
                # outlines writes a pattern between the string's quotes as it stands: give it
                # the JSON-text regex of what jsonschema's re.search accepts
                rewritten, notes = rewrite_patterns(
                    _for_outlines(spec.json_schema), "json", anchor=False, why=_PATTERN_WHY
                )
                notes += _refusals(spec.json_schema)
                digits, raised = _digits_for(spec.json_schema, digits)
                notes += raised
                schema = json.dumps(rewritten, ensure_ascii=False)
            try:
                regex = build_regex_from_schema(
                    schema,
                    whitespace_pattern=_WHITESPACE[spec.whitespace],
                    max_recursion_depth=_MAX_RECURSION_DEPTH,
                )
                regex = _bounded_digits(regex, digits)
                return regex.replace(_STRING_CHAR, _JSON_STRING_CHAR), notes
            except TypeError as e:
                # serde_json's depth limit, said as "Expected a valid JSON string."
                if json_nesting_depth(json.loads(schema)) <= NATIVE_TEXT_DEPTH:
                    raise
                raise GrammarLimitError(
                    f"json_schema: outlines-core 0.2.14 reads JSON nested at most "
                    f"{NATIVE_TEXT_DEPTH} deep (its serde_json: {e}), below max_nesting_depth="
                    f"{self.max_nesting_depth}, which does not lift it: flatten the spec, or "
                    "use xgrammar",
                    backend=self.name,
                    reason=f"JSON text nested past outlines-core's depth {NATIVE_TEXT_DEPTH}",
                ) from e
            except ValueError as e:
                # outlines says "Unsupported ..." / "... is not supported by Outlines" for
                # valid schemas it cannot express.
                cls = (
                    UnsupportedGrammarError if "support" in str(e).lower() else GrammarCompileError
                )
                # one line: the rest is outlines' "Make sure it is valid ... open an issue" advice
                raise cls(
                    f"json_schema: {str(e).strip().splitlines()[0].strip()}", reason=str(e)
                ) from e
        raise UnsupportedGrammarError(f"{spec.kind} is not supported by outlines-core (regex only)")

    def _compile(self, spec: GrammarSpec) -> OutlinesGrammar | LibraryResult:
        regex, notes = self._regex_of(spec)
        size = len(regex.encode("utf-8", "surrogatepass"))
        if self.max_regex_bytes is not None and size > self.max_regex_bytes:
            raise GrammarLimitError(
                f"{spec.kind}: the outlines-core regex of this spec is {size / 2**20:,.1f} MiB "
                f"(over max_regex_bytes={self.max_regex_bytes / 2**20:,.0f} MiB): split the "
                "schema, raise max_regex_bytes, or use another backend (xgrammar, llguidance)",
                reason=f"regex of {size} bytes > max_regex_bytes {self.max_regex_bytes}",
            )
        states = regex_positions(regex)
        if self.max_index_states is not None and (states or 0) > self.max_index_states:
            raise GrammarLimitError(
                f"{spec.kind}: the outlines-core index would have about {states:,} states (over "
                f"max_index_states={self.max_index_states:,}), each a walk of the vocabulary: "
                "lower the repetition counts / length bounds, raise max_index_states, or use "
                "the xgrammar or llguidance backend",
                reason=f"estimated {states} index states > max_index_states {self.max_index_states}",
            )
        estimate = estimated_index_bytes(regex, self.tokenizer_info.tokenizer_vocab_size)
        if self.max_index_bytes is not None and (estimate or 0) > self.max_index_bytes:
            raise GrammarLimitError(
                f"{spec.kind}: the outlines-core index would take about {estimate / 2**20:,.0f} MiB "
                f"(over max_index_bytes={self.max_index_bytes / 2**20:,.0f} MiB): its automaton "
                "has a state for every character of every repeated item or string up to its bound "
                "(maxItems x maxLength); lower those bounds, raise max_index_bytes, or use the "
                "xgrammar or llguidance backend",
                reason=f"estimated index {estimate} bytes > max_index_bytes {self.max_index_bytes}",
            )
        try:
            index = oc.Index(f"(?:{regex}){SENTINEL}", self._vocab.vocabulary)
        except ValueError as e:
            if "NFA" not in str(e):
                raise
            raise GrammarCompileError(
                f"{spec.kind} failed to compile: outlines-core could not build an automaton from the pattern ({e}): "
                "it has a "
                "construct the regex engine lacks (look-around, backreference) or a bound {m,n} with m > n "
                "(such as minItems > maxItems)",
                reason=str(e),
            ) from e
        grammar = OutlinesGrammar(index, self.tokenizer_info, self._vocab, self.mask_cache_bytes)
        if isinstance(spec, JsonSchema) and grammar.is_final(grammar.initial_state):
            # outlines turns unsatisfiable schemas (e.g. `{"enum": []}`) into an empty
            # pattern; no JSON document is empty, so such a grammar accepts nothing.
            raise GrammarCompileError(
                "the schema accepts no JSON document (outlines built an empty pattern)"
            )
        return LibraryResult(grammar, tuple(notes)) if notes else grammar

    def _export_native(self, native: OutlinesGrammar) -> oc.Index:
        # the Index pickles (its transition table: ~0.6 ms for a 340 kB one); the row cache
        # and sentinel bookkeeping are rebuilt here, from this backend's vocabulary
        return native.index

    def _import_native(self, payload: oc.Index) -> OutlinesGrammar:
        return OutlinesGrammar(payload, self.tokenizer_info, self._vocab, self.mask_cache_bytes)

    def _matcher(self, compiled: CompiledGrammar) -> OutlinesMatcher:
        return OutlinesMatcher(self, compiled.native)
