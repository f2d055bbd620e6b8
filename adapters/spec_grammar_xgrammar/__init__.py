"""xgrammar adapter for spec-grammar.

Native paths used: ``GrammarMatcher.rollback`` / ``fork``, ``traverse_draft_tree`` for tree
fills (its rows are then normalized to the protocol: descendants of rejected nodes zeroed),
``find_jump_forward_tokens`` for forced tokens. Validation is emulated (accept + rollback),
since xgrammar 0.2.9 has no non-mutating validate.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import itertools
import json
import math
import os
import re
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from spec_grammar.bitmask import (
    bitmask_width,
    check_bitmask,
    check_bitmask_rows,
)
from spec_grammar.compile import LibraryResult
from spec_grammar.errors import (
    GrammarLimitError,
    GrammarStateError,
    SpecGrammarError,
    UnsupportedGrammarError,
)
from spec_grammar.json_schema.limits import (
    bound_numbers,
    largest_string_enum,
    out_of_range_number,
    types_of,
)
from spec_grammar.json_schema.pattern import UnsupportedPattern, translate_ex
from spec_grammar.json_schema.rewrite import (
    const_within_enum,
    enum_within_type,
    literal_as_schema,
    map_subschemas,
    ref_siblings_dropped,
    rewrite_patterns,
    split_by_type,
)
from spec_grammar.json_schema.strict import (
    LENGTH_WITH_PATTERN,
    NOT_CONTEXT_FREE_KEYWORDS,
    REMOTE_REF,
    REQUIRED_UNDECLARED,
    TYPE_KEYWORDS,
    KeywordSupport,
)
from spec_grammar.limits import regex_forced_bound
from spec_grammar.protocol import Capabilities, CompiledGrammar, GrammarBackend, SpecGrammar
from spec_grammar.shared_native import PathNode, SharedNative
from spec_grammar.specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex
from spec_grammar.traverse import fill_tree_bitmask_dfs, forced_tokens_by_mask
from spec_grammar.tree import DraftTree
from spec_grammar.tree_batch import TreeBatch
from spec_grammar.tree_split import TreePiece, piece_sizes, split_tree
from spec_grammar.vocab import is_rust_tokenizer

try:
    import xgrammar as xgr
except ImportError as e:  # pragma: no cover - exercised when the extra is missing
    raise ImportError("the xgrammar backend needs `pip install xgrammar`") from e

from .strings import bounded_strings_fixed

__all__ = [
    "XGrammarBackend",
    "XGrammarMatcher",
    "DEFAULT_JUMP_FORWARD_SCAN_LIMIT",
    "forced_run_bound",
]

_SEPARATORS = {"spaced": (", ", ": "), "compact": (",", ":")}

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's C++ errors start with its log prefix ``[hh:mm:ss] /path/file.cc:94: ``."""

_PATTERN_WHY = (
    "is not enforced: xgrammar 0.2.9 would read the pattern against the string's JSON text "
    "and ignore this construct (the pattern is left out)"
)

_PATTERN_REFUSES = (
    "xgrammar 0.2.9 misreads escape sequences inside an optional or repeated part of a pattern "
    '(`a(?:\\\\n)?` refused "a\\n"), so pattern strings are written without them: values holding '
    '`"`, `\\` or a control character are refused'
)

_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def _library_log() -> Iterator[list[str]]:
    """Collect what xgrammar's C++ code writes to the process's stderr meanwhile (its
    ``Warning:`` lines for ignored regex constructs are printed there, never raised or
    returned): file descriptor 2 goes to a temporary file, restored afterwards; the lines are
    appended to the yielded list on exit. One capture at a time (a lock): output other threads
    write to stderr meanwhile lands in the same file and is written back to stderr after."""
    lines: list[str] = []
    with _STDERR_LOCK, tempfile.TemporaryFile() as tmp:
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to capture
            yield lines
            return
        try:
            os.dup2(tmp.fileno(), 2)
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", "replace")
            other = []
            for line in text.splitlines():
                (lines if "Warning" in line and _LOG_PREFIX.match(line) else other).append(line)
            if other:  # not ours: give it back
                os.write(2, ("\n".join(other) + "\n").encode())


def _regex_for_xgrammar(pattern: str) -> tuple[str, list[str]]:
    """A ``Regex`` pattern as xgrammar 0.2.9 should get it, with the warnings of the rewrite.

    xgrammar accepts the stop token before anything is written when the pattern starts with a
    character set holding U+0000 (``[^a]+`` and ``(?:[\\x00-z])+`` matched the empty string).
    The pattern is rewritten by :func:`spec_grammar.json_schema.pattern.translate_ex` (explicit
    sets, the same language as ``re.fullmatch``) without U+0000, which a warning then declares;
    a pattern the translation does not support goes to xgrammar as written (it fails or logs,
    and a logged construct is refused)."""
    try:
        r, dropped = translate_ex(f"^(?:{pattern})\\Z", "value", exclude=((0, 0),))
    except (re.error, UnsupportedPattern):
        return pattern, []
    if r is None:
        return pattern, []
    notes = (
        [
            "regex:refuses at /: xgrammar 0.2.9 matches the empty string when a character set holds "
            "U+0000, so U+0000 is left out of the pattern's sets"
        ]
        if dropped
        else []
    )
    return r, notes


def _log_warnings(lines: list[str]) -> list[str]:
    """xgrammar's log lines as compile warnings (``pattern`` for its regex messages)."""
    out = []
    for line in lines:
        msg = _LOG_PREFIX.sub("", line).strip()
        keyword = "pattern" if "regex" in msg.lower() else "library"
        out.append(f"{keyword} at /: xgrammar 0.2.9 logged {msg!r}")
    return list(dict.fromkeys(out))


def _draft2020(schema: Any) -> Any:
    """``schema`` with the draft-04..2019-09 forms xgrammar 0.2.9 refuses rewritten to their
    draft 2020-12 equivalents (the same instances pass): array ``items`` (a tuple) ->
    ``prefixItems`` + ``items`` = ``additionalItems``; boolean ``exclusiveMinimum`` /
    ``exclusiveMaximum`` (draft 04) -> the number of ``minimum`` / ``maximum``; and ``enum``
    values outside the node's ``type`` dropped (:func:`enum_within_type`), ``const`` next to
    ``enum`` reduced to what both allow (:func:`const_within_enum`). Returns ``schema``
    itself (the same object) when nothing needs rewriting."""
    return map_subschemas(ref_siblings_dropped(schema), _draft2020_node)


_UNTYPED = (
    "xgrammar 0.2.9 applies type-specific keywords only where the subschema declares `type` "
    "(here it could not be split by type: anyOf/oneOf/allOf/$ref next to it)"
)
_UNTYPED_REFUSES = (
    "xgrammar 0.2.9 takes such a subschema for the keyword's type only: instances of other "
    "types are refused"
)


def _type_into_branches(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``type`` copied into each ``anyOf`` / ``oneOf`` / ``allOf`` branch
    that has none (the same instances pass: the outer ``type`` applies to them anyway).
    xgrammar 0.2.9 takes the branches' own types instead of intersecting: with
    ``{"type": "string", "anyOf": [{"maxLength": 2}, ...]}`` the split branches let other
    types through (``3`` was accepted)."""
    t = node.get("type")
    if t is None:
        return node
    out = dict(node)
    for k in ("anyOf", "oneOf", "allOf"):
        branches = node.get(k)
        if isinstance(branches, list):
            out[k] = [
                {**b, "type": t}
                if isinstance(b, dict)
                and not any(x in b for x in ("type", "$ref", "enum", "const"))
                else b
                for b in branches
            ]
    return node if out == node else out


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_BOUNDED_NUMBER = (
    "xgrammar 0.2.9 writes a bounded number with at most about 10 fraction digits and no "
    "exponent: smaller magnitudes (0.00000000001) are refused"
)

_BOUNDED_FRACTION_DIGITS = 6
"""Fraction digits xgrammar 0.2.9 writes at most in a number with bounds (its range regex)."""


def _has_number(schema: Any) -> bool:
    """Whether any subschema is typed ``number`` (fractions: what the bounded form limits)."""
    found = []

    def look(node: dict[str, Any], _where: str) -> dict[str, Any]:
        if "number" in types_of(node):
            found.append(True)
        return node

    map_subschemas(schema, look)
    return bool(found)


_ESCAPED_NAME = (
    "xgrammar 0.2.9 does not match a property whose name needs a JSON escape while other "
    "properties are allowed: such a key is taken as an additional property and its value is "
    "not checked"
)


def _escaped_names_note(node: dict[str, Any], where: str, notes: list[str]) -> None:
    props = node.get("properties")
    if isinstance(props, dict) and node.get("patternProperties"):
        notes.append(
            f"properties at {where or '/'}: xgrammar 0.2.9 does not apply the property schemas "
            "next to patternProperties"
        )
    if not isinstance(props, dict) or node.get("additionalProperties") is False:
        return
    if any(json.dumps(k, ensure_ascii=False)[1:-1] != k for k in props):
        notes.append(f"properties at {where or '/'}: {_ESCAPED_NAME}")


def _typed(schema: Any) -> tuple[Any, list[str]]:
    """``schema`` with every untyped subschema split by type (:func:`split_by_type`), and the
    warnings of those that could not be split (xgrammar ignores their type-specific keywords
    for instances of that type and refuses instances of other types)."""
    notes: list[str] = []

    def node(n: dict[str, Any], where: str) -> dict[str, Any]:
        n = _type_into_branches(n)
        _escaped_names_note(n, where, notes)
        if n.get("type") not in ("integer", ["integer"]):
            for k in _BOUNDS:
                if k in n:
                    notes.append(f"{k}:refuses at {where or '/'}: {_BOUNDED_NUMBER}")
        out = split_by_type(n)
        if out is None:
            at = where or "/"
            for k in n:
                if k in TYPE_KEYWORDS:
                    notes.append(f"{k} at {at} (no `type` next to it): {_UNTYPED}")
                    notes.append(f"{k}:refuses at {at} (no `type` next to it): {_UNTYPED_REFUSES}")
            return n
        return out

    return map_subschemas(schema, node), notes


def _draft2020_node(node: dict[str, Any], _where: str) -> dict[str, Any]:
    out = dict(node)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    for excl, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(excl), bool):
            if out.pop(excl) and bound in out:
                out[excl] = out.pop(bound)
    out = literal_as_schema(enum_within_type(const_within_enum(out)))
    return node if out == node else out


DEFAULT_JUMP_FORWARD_SCAN_LIMIT = 65_536
"""Default of ``jump_forward_scan_limit`` (characters)."""


DEFAULT_MAX_ENUM_BYTES = 80_000
"""Default of ``max_enum_bytes``: the JSON text of one ``enum``'s strings. xgrammar 0.2.9
compiles any enum in milliseconds, but past about 90 KB of strings the first mask fill after
the opening quote goes from milliseconds to seconds per thousand strings (SmolLM2: 850 strings
of 100 characters, 87 KB, 6 ms; 1,000 of 100, 102 KB, 17 s; 2,000 of 50, 104 KB, 15 s; 5,000 of 20, 68 s;
10,000 of 16, over 100 s: ``docs/reliability.md``)."""


def forced_run_bound(spec: GrammarSpec) -> int | None:
    """An upper bound on the characters ``spec`` can force in one run, or None when none is
    known (EBNF and Lark: a recursive rule can force a run of any length).

    ``Regex``: :func:`spec_grammar.limits.regex_forced_bound`. ``JsonSchema``: every literal the
    grammar writes is in the schema's text, and a pattern or an array's ``minItems`` copies can
    repeat it: (schema bytes + the patterns' bounds) x the product of ``minItems + 1`` over the
    schema (loose, never too low)."""
    if isinstance(spec, Regex):
        return regex_forced_bound(spec.pattern)
    if not isinstance(spec, JsonSchema):
        return None
    size, factor = len(spec.cache_key()), 1
    todo = [spec.json_schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            pattern, items = node.get("pattern"), node.get("minItems")
            if isinstance(pattern, str):
                bound = regex_forced_bound(pattern)
                if bound is None:
                    return None
                size += bound
            if isinstance(items, (int, float)) and not isinstance(items, bool) and items > 0:
                factor *= int(items) + 1
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return size * factor


_NEVER_TEXT = b"\xff"
"""Text given to special tokens: a byte that never occurs in UTF-8, so never in a grammar's
language."""


def _native_accept(m: xgr.GrammarMatcher, token: int) -> bool:
    return m.accept_token(token)


def _native_rollback(m: xgr.GrammarMatcher, k: int) -> None:
    m.rollback(k)


def _native_copy(m: xgr.GrammarMatcher) -> xgr.GrammarMatcher:
    return m.fork()


MIN_FILL_WORK_PER_THREAD = 0.004
"""Seconds of walk work (CPU time, measured in the previous fill) per fill thread below which a
batched fill uses fewer threads: every walk hands the GIL back and forth around its native call,
and with little work per thread those handoffs cost more than the thread saves (H200 host, 16
cores, batch 128 x 16 nodes, SmolLM2: 8.5 ms at 4 threads, 14.4 ms at 16)."""


class XGrammarMatcher(SpecGrammar):
    """:class:`SpecGrammar` over ``xgrammar.GrammarMatcher``.

    The library matcher is shared with this matcher's forks (:mod:`spec_grammar.shared_native`):
    xgrammar 0.2.9's own ``fork`` copies every token accepted so far, so a fork here is O(1)
    and the library matcher is moved (rollback + replay) to whichever view is used.
    ``shared`` / ``node``: the view's place when it is a fork (left out: a new shared native
    over ``matcher``)."""

    def __init__(
        self,
        backend: XGrammarBackend,
        matcher: xgr.GrammarMatcher | None = None,
        *,
        shared: SharedNative | None = None,
        node: PathNode | None = None,
    ):
        super().__init__(backend.tokenizer_info, max_rollback_tokens=backend.max_rollback_tokens)
        self._backend = backend
        if shared is None:
            shared = SharedNative(
                matcher,
                accept=_native_accept,
                rollback=_native_rollback,
                copy=_native_copy,
                detach_after=max(self._max_rollback_tokens, 64),
            )
        self._shared = shared
        self._node = shared.root if node is None else node
        self._jump_forward = True  # xgrammar's own jump-forward (set by the backend)

    def _enter(self) -> xgr.GrammarMatcher:
        """The library matcher, moved to this view (the caller holds ``self._shared.lock``)."""
        self._shared, self._node = self._shared.enter(self._node)
        return self._shared.native

    @property
    def _m(self) -> xgr.GrammarMatcher:
        """The library matcher at this view's state (valid until another view is used)."""
        with self._shared.lock:
            return self._enter()

    def _accept_token(self, token: int) -> bool:
        # special ids are refused here: xgrammar would log a line for each
        if token in self._backend._special_set:
            return False
        with self._shared.lock:
            if not self._enter().accept_token(token):
                return False
            self._node = self._shared.pushed(self._node, token)
            return True

    def _accept_tokens(self, tokens: list[int]) -> int:
        # xgrammar refuses every token once terminated: no termination check per token
        accept, n = self._accept_token, 0
        with self._shared.lock:  # once for the run (reentrant)
            for t in tokens:
                if not accept(t):
                    break
                n += 1
        return n

    def _rollback(self, num_tokens: int) -> None:
        # the library matcher follows when this view is next used
        self._node = self._shared.up(self._node, num_tokens)

    def _fork(self) -> XGrammarMatcher:
        twin = XGrammarMatcher(self._backend, shared=self._shared, node=self._node)
        twin._jump_forward = self._jump_forward
        return twin

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        with self._shared.lock:
            m = self._enter()
            self._fill_rows(bitmask[row : row + 1], lambda rows: m.fill_next_token_bitmask(rows, 0))

    def _is_terminated(self) -> bool:
        with self._shared.lock:
            return self._enter().is_terminated()

    def _forced_tokens(self) -> list[int]:
        if not self._jump_forward:
            # xgrammar's jump-forward has no length limit: bounded mask fills instead
            return forced_tokens_by_mask(self, self.max_forced_tokens)
        # xgrammar drops a trailing token that could be the prefix of a longer one, so every
        # returned token is forced; stop tokens are never part of a jump-forward string.
        with self._shared.lock:
            tokens = self._enter().find_jump_forward_tokens()
        return [t for t in tokens if not self.is_stop_token(t)]

    def _fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        return self._fill_tree(tree, bitmask, row_offset, zero_dead=True)

    def _fill_tree_rows(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        return self._fill_tree(tree, bitmask, row_offset, zero_dead=False)

    def _fill_tree(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int, zero_dead: bool
    ) -> torch.Tensor:
        n = tree.num_nodes
        tokens = tree.token_list
        if n > 1 and (min(tokens[1:]) < 0 or max(tokens[1:]) >= self.info.tokenizer_vocab_size):
            # Out-of-range ids must never reach the library's bit test.
            return fill_tree_bitmask_dfs(self, tree, bitmask, row_offset, zero_dead=zero_dead)
        # one array for the links and the tokens (each numpy call costs ~1 µs, a sizable
        # share of a small tree's fill)
        links = np.array((tree.first_child_list, tree.next_sibling_list, tokens), dtype=np.int64)
        words = self._traverse(tree, links, bitmask, row_offset)
        valid = self._fix_stale_rows(tree, words, zero_dead) if n > 1 else [True]
        return torch.from_numpy(np.array(valid, dtype=bool))

    def _traverse(
        self, tree: DraftTree, links: np.ndarray, bitmask: torch.Tensor, row_offset: int
    ) -> np.ndarray:
        """xgrammar's own walk of ``tree`` into rows ``[row_offset, row_offset + N)`` of
        ``bitmask``; ``links`` ``(3, N)`` int64 holds the first-child, next-sibling and token
        rows (the tokens may stand in for the tree's). Returns those rows as a
        writable numpy view. Rows below rejected nodes are left stale (G8)."""
        rows = bitmask[row_offset : row_offset + tree.num_nodes]
        # numpy link arrays (xgrammar takes any DLPack array): a third of the cost of torch
        # tensors, which dominated the fill of a small tree with the validity pass
        first_child, next_sibling, tokens = links[0], links[1], links[2]
        with self._shared.lock:
            m = self._enter()
            if not self._backend._narrow:
                m.traverse_draft_tree(first_child, next_sibling, tokens, rows)
            else:
                self._fill_rows(
                    rows,
                    lambda out: m.traverse_draft_tree(first_child, next_sibling, tokens, out),
                )
        return rows.numpy()

    def _fill_rows(self, rows: torch.Tensor, fill) -> None:
        """``fill(out)`` writes xgrammar's rows into ``out``: ``rows`` itself, or the thread's
        tokenizer-wide scratch copied into ``rows`` when the model's head is wider (the padding
        words are left to the protocol, which zeroes them)."""
        narrow = self._backend._narrow_rows(rows.shape[0])
        if narrow is None:
            fill(rows)
            return
        fill(narrow)
        rows.numpy()[:, : narrow.shape[1]] = narrow.numpy()  # numpy: see _fill_batch

    def _fix_stale_rows(self, tree: DraftTree, words: np.ndarray, zero_dead: bool) -> list[bool]:
        """Node validity of a traversed ``tree`` whose rows are ``words`` ``(N, W)`` int32;
        rows of dead nodes zeroed in place when ``zero_dead``.

        xgrammar zeroes the rows of rejected nodes but leaves their descendants' rows stale
        (G8). A node is valid when its parent is valid and not a stop token and its token's
        bit is set in its parent's row; its row is dead when it is invalid or a stop token.
        Nodes come after their parents, so one pass in node order settles every ancestor, and
        only the children of valid nodes read a bit (a vectorized gather over every node cost
        more than this loop at 16-64 nodes)."""
        n = tree.num_nodes
        parents, tokens, stops = tree.parent_list, tree.token_list, self._backend._stop_set
        valid = [False] * n
        valid[0] = True
        for i in range(1, n):
            p = parents[i]
            if valid[p] and (p == 0 or tokens[p] not in stops):
                t = tokens[i]
                valid[i] = (int(words[p, t >> 5]) >> (t & 31)) & 1 == 1
        if zero_dead:
            dead = [i for i in range(1, n) if not valid[i] or tokens[i] in stops]
            if dead:
                words[dead] = 0
        return valid


class XGrammarBackend(GrammarBackend):
    """xgrammar (https://github.com/mlc-ai/xgrammar) behind the spec-grammar protocol.

    Extra options:

    - ``max_threads``: compiler threads (default 1: on small hosts more threads only add
      contention).
    - ``num_threads``: threads that fill many requests' tree rows side by side in
      :meth:`fill_tree_bitmasks` (default 1: one after another). xgrammar's calls release the
      GIL (tvm-ffi), but the adapter's Python around them does not: threads pay only where
      xgrammar's own fill dominates. A tree that outweighs half a thread's share of the batch
      is cut into pieces walked side by side, and a batch with under
      :data:`MIN_FILL_WORK_PER_THREAD` of walk work per thread uses fewer threads. Measured on
      a 16-core host, 128 requests, 16 threads against one (``benchmarks/results/serving/``):
      Gemma-3's 262k vocabulary 8.3x (16-node trees) and 7.6x (64); SmolLM2's 49k, 2.1x and
      4.9x (its walks are 50-100 us each, and the Python around each one is serial).
    - ``dynamic_compilation`` (default ``True``): xgrammar builds each grammar position's
      token-mask cache the first time a matcher reaches it (``GrammarCompiler(...,
      enable_dynamic_compilation=True)``) instead of for every position at compile time. Same
      grammar, same masks; only where the time is spent changes. JSON-Schema semantics
      (``strict_mode=False``) make every object without ``additionalProperties: false`` accept
      extra keys other than its declared names, which xgrammar encodes as a trie with one rule
      per byte of every declared name, and each such rule costs a full-vocabulary scan (~3-6
      ms at 49k tokens on one core). Eagerly that is ~100-300 ms per BFCL tool list on SmolLM2
      while a generation visits only a few of those positions (measured in
      ``benchmarks/bench_compile.py``). The cost moves to the first mask fill of each new
      position (a few ms at most, once per compiled grammar); pass ``False`` to pay it all up
      front and keep decode steps free of it.
    - ``max_enum_bytes`` (default :data:`DEFAULT_MAX_ENUM_BYTES`; None = no limit): a JSON
      schema with an ``enum`` whose strings take more JSON text than this is refused with
      :class:`GrammarLimitError` before the library sees it (:func:`largest_string_enum`;
      xgrammar's first fills stall on it; ``auto`` then routes it to the next backend).
    - ``jump_forward_scan_limit`` (characters, default :data:`DEFAULT_JUMP_FORWARD_SCAN_LIMIT`;
      None = always): ``forced_tokens`` uses xgrammar's jump-forward (which walks the whole
      forced run, however long) only for grammars whose forced runs are known to be at most
      this long (:func:`forced_run_bound`); others (EBNF, Lark, huge repetition counts) find
      forced tokens by at most ``max_forced_tokens`` mask fills.
    """

    name = "xgrammar"
    library_requirement = "xgrammar>=0.2.9"  # the oldest release tested (the extra's pin)
    # xgrammar 0.2.9 segfaults on a $ref chain of 4,000 object links (nesting 12,003; 3,000,
    # 9,003, compile; a bare chain of 4,000 links, 4,003, compiles in 46 s);
    # its EBNF / Lark / JSON parsers have their own nesting limits (typed errors)
    native_max_nesting_depth = 4000
    capabilities = Capabilities(
        json_schema=True,
        regex=True,
        ebnf=True,
        lark=True,
        tool_calls=True,
    )
    # max_whitespace: max_whitespace_cnt; max_digits: numeric bounds (bound_numbers), which
    # xgrammar writes as digit ranges with at most 6 fraction digits and no exponent
    output_limits = frozenset({"max_whitespace", "max_digits"})
    # Measured on the JSON-Schema-Test-Suite (tests/test_reliability_strict.py).
    json_schema_support = KeywordSupport(
        unenforced={
            **dict.fromkeys(
                NOT_CONTEXT_FREE_KEYWORDS,
                "not converted by xgrammar 0.2.9's JSON-schema converter (ignored)",
            ),
            "uniqueItems": "xgrammar 0.2.9 ignores uniqueItems (not context-free)",
            "multipleOf": "xgrammar 0.2.9 ignores multipleOf for numbers and non-integer multipleOf",
            "allOf": "xgrammar 0.2.9 merges only simple allOf branches",
            "oneOf": "xgrammar 0.2.9 treats oneOf as anyOf",
            "patternProperties": "xgrammar 0.2.9 does not apply patternProperties to every matching key",
            "minProperties": "xgrammar 0.2.9 ignores minProperties on objects with additional properties",
            "maxProperties": "xgrammar 0.2.9 ignores maxProperties on objects with additional properties",
            REQUIRED_UNDECLARED: "xgrammar 0.2.9 ignores required names that properties does not define",
            LENGTH_WITH_PATTERN: "xgrammar 0.2.9 ignores minLength/maxLength next to pattern or format",
            REMOTE_REF: "xgrammar 0.2.9 resolves only local '#/...' references (others match anything)",
        },
        # untyped subschemas: split by type, or declared, by the adapter (_typed)
        restricted={
            "format": (
                "xgrammar 0.2.9 asserts the formats it knows, where Draft 2020-12 makes `format` an "
                "annotation: strings off the format are refused"
            ),
            # the text of bounded strings is JSON (strings.py); escapes cost too much there
            **dict.fromkeys(
                ("minLength", "maxLength"),
                "xgrammar 0.2.9 writes a length-bounded string without escape sequences: values "
                'holding `"`, `\\` or a control character are refused',
            ),
            **dict.fromkeys(
                ("unevaluatedItems", "unevaluatedProperties"),
                "xgrammar 0.2.9 reads it as items / additionalProperties of its own subschema, "
                "refusing what a sibling applicator evaluated",
            ),
            "patternProperties": "xgrammar 0.2.9 refuses some keys a pattern allows",
            **dict.fromkeys(
                ("minContains", "maxContains"),
                "xgrammar 0.2.9 reads it without `contains` as a count of items",
            ),
        },
    )

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_threads: int = 1,
        num_threads: int | None = None,
        dynamic_compilation: bool = True,
        jump_forward_scan_limit: int | None = DEFAULT_JUMP_FORWARD_SCAN_LIMIT,
        max_enum_bytes: int | None = DEFAULT_MAX_ENUM_BYTES,
        **kwargs: Any,
    ):
        super().__init__(tokenizer, **kwargs)
        self.max_enum_bytes = None if max_enum_bytes is None else int(max_enum_bytes)
        self.num_threads = int(num_threads) if num_threads else 1
        self._fill_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.jump_forward_scan_limit = (
            None if jump_forward_scan_limit is None else int(jump_forward_scan_limit)
        )
        self._jump_forward_cache: weakref.WeakKeyDictionary[CompiledGrammar, bool] = (
            weakref.WeakKeyDictionary()
        )
        info = self.tokenizer_info
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if is_rust_tokenizer(info.hf_tokenizer):
                # xgrammar's from_huggingface takes transformers tokenizers only ("Unsupported
                # tokenizer type"): the tokens' bytes are what it decodes a transformers
                # tokenizer's vocabulary to (the same table for SmolLM2)
                decoded = list(info.token_bytes)
                add_prefix_space = False
            else:
                hf_info = xgr.TokenizerInfo.from_huggingface(
                    info.hf_tokenizer,
                    vocab_size=info.tokenizer_vocab_size,
                    stop_token_ids=list(info.stop_token_ids),
                )
                decoded = list(hf_info.decoded_vocab)
                add_prefix_space = hf_info.add_prefix_space
        self._stop_set = frozenset(int(t) for t in info.stop_token_ids)
        # xgrammar 0.2.9 reads added tokens (<|im_start|>, <repo_name>, ...) as their text, so
        # a JSON string allowed them, and a stop token too (`[^a]+` accepted <|im_end|> as its
        # first "characters", without terminating). Stop tokens get empty text (xgrammar knows
        # them from stop_token_ids); the other special ids get the byte 0xFF, which no UTF-8
        # text holds, so no grammar accepts them (as none accepts the byte-fallback token
        # <0xFF>). Empty text would do too (xgrammar never allows such tokens), but it lists
        # them and rejects them one by one in every mask: Gemma-3's 6,249 specials made each
        # row fill 1.3-2.3x slower (7-10 µs a row).
        self._special_set = frozenset(info.special_token_ids) - self._stop_set
        for t in self._special_set:
            if t < len(decoded):
                decoded[t] = _NEVER_TEXT
        for t in self._stop_set:
            if t < len(decoded):
                decoded[t] = b""
        self._xgr_info = xgr.TokenizerInfo(
            decoded,
            xgr.VocabType.RAW,
            vocab_size=info.tokenizer_vocab_size,
            stop_token_ids=list(info.stop_token_ids),
            add_prefix_space=add_prefix_space,
        )
        # xgrammar's masks cover the tokenizer's ids only: told about the model's padding ids
        # too, it treats them as special tokens that every mask rejects one by one, and a model
        # head wider than its tokenizer (here: 128k rows, a 49k tokenizer) made tree fills ~15x
        # slower. Its rows are then filled narrow and copied into the wide bitmask.
        self._xgr_width = bitmask_width(info.tokenizer_vocab_size)
        self._narrow = self._xgr_width < bitmask_width(info.vocab_size)
        self._scratch = threading.local()  # per thread: grammar threads fill side by side
        # each library matcher's fill time per row in its last batched fill (s): which trees
        # to cut into pieces (weak: a finished request's matcher leaves)
        self._row_cost: weakref.WeakKeyDictionary[SharedNative, float] = weakref.WeakKeyDictionary()
        self._compiler = xgr.GrammarCompiler(
            self._xgr_info,
            max_threads=max_threads,
            cache_enabled=False,
            enable_dynamic_compilation=bool(dynamic_compilation),
        )

    def _narrow_rows(self, n: int) -> torch.Tensor | None:
        """A contiguous ``(n, W_tokenizer)`` int32 scratch of this thread for xgrammar to fill,
        or None when the model's bitmask is xgrammar's own width."""
        if not self._narrow:
            return None
        buf = getattr(self._scratch, "rows", None)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch.rows = torch.empty((max(n, 64), self._xgr_width), dtype=torch.int32)
        return buf[:n]

    def fill_tree_bitmasks(
        self,
        jobs: Sequence[tuple[SpecGrammar, DraftTree, int]],
        bitmask: torch.Tensor,
        *,
        zero_dead_rows: bool = True,
    ) -> list[torch.Tensor]:
        """Fill the tree rows of many requests, ``jobs`` = ``(matcher, tree, row_offset)``;
        rows and the returned ``(N,)`` bool ``valid`` tensors are exactly those of
        :meth:`SpecGrammar.fill_tree_bitmask` per job (``zero_dead_rows`` as there).

        One batched pass: every job's library matcher is moved to its state and the links of
        all trees built as one array (:class:`~spec_grammar.tree_batch.TreeBatch`) on the
        calling thread; then only xgrammar's own walks run, one per tree, spread over
        ``num_threads`` threads by node count (each releases the GIL for its whole walk);
        then the validity of every node and the dead rows of the batch are settled in a few
        vectorized passes. Jobs this pass cannot take (another backend's matcher, a subclass
        with its own tree fill, a second view of one library matcher, ids outside the
        tokenizer) are filled one by one afterwards.
        Raises what :meth:`SpecGrammar.fill_tree_bitmask` raises (the first failing job's
        error, once every other job is filled)."""
        check_bitmask(bitmask, self.vocab_size)
        results: list[torch.Tensor | None] = [None] * len(jobs)
        batch: list[int] = []
        rest: list[int] = []
        errors: dict[int, BaseException] = {}
        seen: set[int] = set()
        n_tok = self.tokenizer_info.tokenizer_vocab_size
        for i, (m, tree, off) in enumerate(jobs):
            fits = (
                isinstance(m, XGrammarMatcher)
                # a subclass with its own tree fill is filled by it, not by the library walk
                and type(m)._fill_tree_bitmask is XGrammarMatcher._fill_tree_bitmask
                and m._backend is self
                and isinstance(tree, DraftTree)
                and id(m._shared) not in seen
                and isinstance(off, int)
                and not isinstance(off, bool)
            )
            if fits and tree.num_nodes > 1:
                tokens = tree.token_list
                fits = 0 <= min(tokens[1:]) and max(tokens[1:]) < n_tok
            if not fits:
                rest.append(i)
                continue
            try:
                check_bitmask_rows(bitmask, off, tree.num_nodes)
                if m.is_terminated():
                    raise GrammarStateError("fill_tree_bitmask on a terminated matcher")
            except SpecGrammarError as e:
                errors[i] = e
                continue
            seen.add(id(m._shared))
            batch.append(i)
        if batch:
            try:
                valids = self._fill_batch([jobs[i] for i in batch], bitmask, zero_dead_rows)
            except Exception:  # noqa: BLE001  (a library matcher failed to move: find which)
                rest = sorted(batch + rest)
            else:
                for i, valid in zip(batch, valids):
                    results[i] = valid
        for i in rest:
            m, tree, off = jobs[i]
            try:
                results[i] = m.fill_tree_bitmask(tree, bitmask, off, zero_dead_rows=zero_dead_rows)
            except Exception as e:  # noqa: BLE001  (re-raised once every job is filled)
                errors[i] = e
        if errors:
            raise errors[min(errors)]
        return results  # type: ignore[return-value]

    def _fill_batch(
        self,
        jobs: list[tuple[XGrammarMatcher, DraftTree, int]],
        bitmask: torch.Tensor,
        zero_dead: bool,
    ) -> list[torch.Tensor]:
        """:meth:`fill_tree_bitmasks` for jobs of distinct library matchers of this backend,
        every tree's ids inside the tokenizer.

        ``num_threads`` threads take work one item at a time, costliest first, from a shared
        counter (a job's cost varies by far more than its node count: a state inside a string
        fills a row in microseconds, one before a large object's keys in milliseconds, so
        fixed shares left most threads idle behind the slowest one). An item is a job's whole
        walk or, for a job whose rows cost more than half a thread's share of the batch in the
        previous fill (:func:`~spec_grammar.tree_split.piece_sizes`), a piece of its tree
        (:func:`~spec_grammar.tree_split.split_tree`) walked by a fork of its library matcher
        moved along the path to the piece: one request's tree was 44% of a step at 128 x 64
        nodes on Gemma-3 (issue 35). Each thread puts its rows in place (under a model head
        wider than the tokenizer, xgrammar writes a tokenizer-wide scratch, which the thread
        copies into the bitmask) and clears their padding ids, with numpy copies that release
        the GIL: the rows' memory traffic (~50 MB at 128 x 64 nodes over a 128k head) is
        spread over the threads too."""
        trees = [t for _, t, _ in jobs]
        tb = TreeBatch(trees, [off for _, _, off in jobs])
        total = int(tb.starts[-1])
        starts = tb.starts.tolist()
        offs = [off for _, _, off in jobs]
        scratch = self._narrow_rows(total)
        dest = bitmask if scratch is None else scratch
        width = dest.shape[1]
        word, bit = divmod(self.tokenizer_info.tokenizer_vocab_size, 32)
        links = tb.links
        # numpy, not torch: a small torch op from many threads starts an OpenMP region each
        # (a 16-row zero_ took 1.6 ms against 11 us single-threaded on a loaded host)
        words, scratch_words = bitmask.numpy(), None if scratch is None else scratch.numpy()

        def clear_padding(rows: np.ndarray) -> None:
            if word < rows.shape[1]:  # ids past the tokenizer are never allowed
                if bit:
                    rows[:, word] &= (1 << bit) - 1
                rows[:, word + (1 if bit else 0) :] = 0

        def place(a: int, b: int, lo: int) -> None:
            """Nodes ``[a, b)`` (flat) into bitmask rows ``[lo, lo + b - a)``."""
            rows = words[lo : lo + b - a]
            if scratch_words is not None:
                rows[:, :width] = scratch_words[a:b]
            clear_padding(rows)

        with contextlib.ExitStack() as locks:
            for m, _, _ in sorted(jobs, key=lambda job: id(job[0]._shared)):
                locks.enter_context(m._shared.lock)
            natives = [m._enter() for m, _, _ in jobs]
            shareds = [m._shared for m, _, _ in jobs]
            items, threads = self._work_items(trees, shareds)
            spent = [0.0] * len(items)  # seconds per item (each written by one thread)
            # the library calls without their Python wrapper: no work between native calls
            fns = [native._handle.traverse_draft_tree for native in natives]
            taken = itertools.count()

            def piece_walk(j: int, piece: TreePiece) -> None:
                native = natives[j]._handle.fork()
                path = piece.path
                for depth, t in enumerate(path):
                    if not native.accept_token(t, False):
                        # as the whole walk: a rejected node's row is zeroed, rows below it
                        # are left (the validity pass reads neither)
                        if depth == len(path) - 1 and piece.owns_anchor:
                            words[offs[j] + piece.anchor] = 0
                        return
                k = len(piece.nodes)
                out = self._piece_rows(k)
                lk = piece.links
                native.traverse_draft_tree(lk[0], lk[1], lk[2], out, -1.0, None)
                src = out.numpy()[0 if piece.owns_anchor else 1 : k]
                rows = np.zeros((len(src), words.shape[1]), dtype=words.dtype)
                rows[:, : src.shape[1]] = src
                clear_padding(rows)
                words[offs[j] + piece.rows] = rows  # scattered rows: one fancy-index write

            def share(_k: int) -> None:
                # next() of itertools.count is atomic under the GIL: each item runs once
                while (i := next(taken)) < len(items):
                    j, piece = items[i]
                    # CPU time: a thread waiting for the GIL or the OS is not charged for it
                    t0 = time.thread_time()
                    if piece is None:
                        a, b = starts[j], starts[j + 1]
                        out = dest[offs[j] : offs[j] + b - a] if scratch is None else dest[a:b]
                        fns[j](links[0, a:b], links[1, a:b], links[2, a:b], out, -1.0, None)
                        place(a, b, offs[j])
                    else:
                        piece_walk(j, piece)
                    spent[i] = time.thread_time() - t0

            self._run_shares(share, threads)
            per_job = [0.0] * len(jobs)
            for (j, _), s in zip(items, spent):
                per_job[j] += s
            for shared, tree, s in zip(shareds, trees, per_job):
                self._row_cost[shared] = s / tree.num_nodes
        valid, dead = tb.settle(words, self._stop_set)
        if zero_dead and dead.any():
            words[tb.rows[dead]] = 0
        return list(torch.from_numpy(valid).split([t.num_nodes for t in trees]))

    def _work_items(
        self, trees: list[DraftTree], shareds: list[SharedNative]
    ) -> tuple[list[tuple[int, TreePiece | None]], int]:
        """The work of one batched fill, costliest first, and the threads to run it on.

        Items: ``(job, None)`` for a whole walk, ``(job, piece)`` for each piece of a tree
        worth cutting. Costs: each library matcher's row cost in its previous fill (a matcher
        not seen yet counts one row at the batch's median). Threads: ``num_threads``, fewer
        where the batch's known cost is under :data:`MIN_FILL_WORK_PER_THREAD` per thread."""
        sizes = [t.num_nodes for t in trees]
        known = [self._row_cost.get(s) for s in shareds]
        seen = sorted(c for c in known if c is not None)
        fallback = seen[len(seen) // 2] if seen else 0.0
        costs = [(c if c is not None else fallback) * n for c, n in zip(known, sizes)]
        threads = max(1, self.num_threads)
        if seen:
            threads = min(threads, max(1, math.ceil(sum(costs) / MIN_FILL_WORK_PER_THREAD)))
        cuts = piece_sizes([c if k is not None else None for c, k in zip(costs, known)],
                           sizes, threads)  # fmt: skip
        items: list[tuple[float, int, TreePiece | None]] = []
        for j, (tree, cost, max_rows) in enumerate(zip(trees, costs, cuts)):
            if not max_rows:
                items.append((cost, j, None))
                continue
            stops = self._stop_set
            tokens, parents = tree.token_list, tree.parent_list
            below_stop = [False] * tree.num_nodes  # at or below a stop token
            for v in range(1, tree.num_nodes):
                below_stop[v] = below_stop[parents[v]] or tokens[v] in stops
            cuttable = np.logical_not(below_stop)
            for piece in split_tree(tree, max_rows, cuttable):
                items.append((cost * len(piece.nodes) / tree.num_nodes, j, piece))
        items.sort(key=lambda item: -item[0])
        return [(j, piece) for _, j, piece in items], min(threads, len(items))

    def _piece_rows(self, n: int) -> torch.Tensor:
        """A contiguous ``(n, W_tokenizer)`` int32 scratch of this thread for a piece's walk."""
        buf = getattr(self._scratch, "piece", None)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch.piece = torch.empty(
                (max(n, 64), self._xgr_width), dtype=torch.int32
            )
        return buf[:n]

    def _run_shares(self, share: Callable[[int], None], count: int) -> None:
        """``share(k)`` for ``k < count``: the caller's thread takes share 0, the fill pool's
        threads the others; raises the first share's error once all ran."""
        if count <= 1:
            share(0)
            return
        with self._pool_lock:
            if self._fill_pool is None or self._fill_pool._max_workers < count - 1:
                if self._fill_pool is not None:
                    self._fill_pool.shutdown(wait=False)
                self._fill_pool = concurrent.futures.ThreadPoolExecutor(
                    max(count, self.num_threads) - 1,
                    thread_name_prefix="spec-grammar-xgrammar-fill",
                )
            pool = self._fill_pool
        futures = [pool.submit(share, k) for k in range(1, count)]
        error: BaseException | None = None
        try:
            share(0)
        except BaseException as e:  # noqa: BLE001  (re-raised once the pool's shares are done)
            error = e
        for f in futures:
            e = f.exception()
            if error is None and e is not None:
                error = e
        if error is not None:
            raise error

    @classmethod
    def library_version(cls) -> str:
        return importlib.metadata.version("xgrammar")

    @classmethod
    def _library_error_reason(cls, error: Exception) -> str:
        # the log prefix names a build path, not the grammar; the message ends with blank lines;
        # Lark errors end with the source line and a caret under the column (which the first
        # line names already): dropped, so that the reason is one line
        lines: list[str] = []
        for line in _LOG_PREFIX.sub("", str(error)).strip().splitlines():
            if line.strip() and set(line.strip()) == {"^"}:
                if len(lines) > 1:
                    lines.pop()
                continue
            if line.strip():
                lines.append(line.strip())
        return " ".join(lines)

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if isinstance(spec, JsonSchema):
            self._check_enums(spec)
            wide = out_of_range_number(spec.json_schema)
            if wide is not None:
                raise GrammarLimitError(
                    f"json_schema: the {wide} is outside what xgrammar 0.2.9 reads (numbers "
                    "within a double's range, integer bounds within 64 bits): use a smaller "
                    "bound",
                    backend=self.name,
                    reason=f"number out of xgrammar's range: {wide}",
                )
            schema = spec.schema_json() if spec.json_schema is not True else "{}"
            older = _draft2020(spec.json_schema)
            older, untyped = _typed(older)
            limits = spec.limits
            digits = limits.max_digits if limits is not None else None
            # after _typed: the bounds added for the limit refuse exactly what it asks to refuse
            older = bound_numbers(older, digits)
            # xgrammar matches a pattern in full against the JSON text of the string: give it
            # the translated JSON-text regex of what jsonschema's re.search accepts
            older, notes = rewrite_patterns(
                older,
                "json",
                anchor=False,
                why=_PATTERN_WHY,
                escapes=False,
                refuses=_PATTERN_REFUSES,
            )
            notes = untyped + notes
            if digits is not None and digits < _BOUNDED_FRACTION_DIGITS:
                notes.append(
                    f"max_digits at /: xgrammar 0.2.9 writes up to {_BOUNDED_FRACTION_DIGITS} "
                    f"fraction digits in a bounded number, more than max_digits={digits}"
                )
            elif digits is not None and digits > _BOUNDED_FRACTION_DIGITS and _has_number(older):
                notes.append(
                    f"max_digits:refuses at /: xgrammar 0.2.9 writes at most "
                    f"{_BOUNDED_FRACTION_DIGITS} fraction digits in a bounded number, fewer than "
                    f"max_digits={digits} allows"
                )
            if older is not spec.json_schema:
                schema = json.dumps(older, ensure_ascii=False)
            flexible = spec.whitespace == "flexible"
            runs = limits.max_whitespace if limits is not None and flexible else None
            with _library_log() as log:
                grammar = xgr.Grammar.from_json_schema(
                    schema,
                    any_whitespace=flexible,
                    separators=None if flexible else _SEPARATORS[spec.whitespace],
                    strict_mode=False,
                    max_whitespace_cnt=runs,
                )
                if "Length" in schema:  # minLength / maxLength: cheap to rule out
                    grammar = bounded_strings_fixed(grammar) or grammar
                native = c.compile_grammar(grammar)
            notes += _log_warnings(log)
            return LibraryResult(native, tuple(notes)) if notes else native
        if isinstance(spec, Regex):
            pattern, notes = _regex_for_xgrammar(spec.pattern)
            with _library_log() as log:
                native = c.compile_regex(pattern)
            if log:
                # a Regex has no lenient mode: a construct xgrammar ignores makes another
                # language, so the spec is refused rather than weakened
                raise UnsupportedGrammarError(
                    "xgrammar 0.2.9 would ignore part of the regex: "
                    + "; ".join(_LOG_PREFIX.sub("", x).strip() for x in log[:3])
                )
            return LibraryResult(native, tuple(notes)) if notes else native
        if isinstance(spec, Ebnf):
            return c.compile_grammar(spec.text, root_rule_name=spec.root)
        if isinstance(spec, Lark):
            return c.compile_grammar(xgr.Grammar.from_lark(spec.text))
        raise UnsupportedGrammarError(f"{spec.kind} is not supported by xgrammar")

    def _check_enums(self, spec: JsonSchema) -> None:
        """Raise :class:`GrammarLimitError` for an ``enum`` of strings past ``max_enum_bytes``
        (:func:`largest_string_enum`): its first mask fills would stall for minutes."""
        if self.max_enum_bytes is None:
            return
        size, where = largest_string_enum(spec.json_schema)
        if size > self.max_enum_bytes:
            raise GrammarLimitError(
                f"json_schema: the enum at {where} has {size} bytes of strings, over "
                f"max_enum_bytes={self.max_enum_bytes}: xgrammar 0.2.9's first mask fills take "
                "seconds per thousand strings past ~90 KB; use llguidance (or auto, which "
                "routes there), or pass max_enum_bytes= (None: no limit) to xgrammar",
                backend=self.name,
                reason=f"enum of {size} bytes > max_enum_bytes {self.max_enum_bytes}",
            )

    def _export_native(self, native: Any) -> str:
        return native.serialize_json()

    def _import_native(self, payload: str) -> Any:
        return xgr.CompiledGrammar.deserialize_json(payload, self._xgr_info)

    def _matcher(self, compiled: CompiledGrammar) -> XGrammarMatcher:
        m = XGrammarMatcher(self, xgr.GrammarMatcher(compiled.native))
        m._jump_forward = self._jump_forward_ok(compiled)
        return m

    def _jump_forward_ok(self, compiled: CompiledGrammar) -> bool:
        """Whether xgrammar's jump-forward may run on ``compiled``: its cost and memory grow
        with the forced run (2 us and ~70 bytes a character: ``a{100000000}`` would take minutes
        and gigabytes, a rule that forces itself for ever until memory runs out), so only where
        :func:`forced_run_bound` is at most ``jump_forward_scan_limit`` (cached per grammar)."""
        ok = self._jump_forward_cache.get(compiled)
        if ok is None:
            bound = forced_run_bound(compiled.spec)
            limit = self.jump_forward_scan_limit
            ok = limit is None or (bound is not None and bound <= limit)
            self._jump_forward_cache[compiled] = ok
        return ok
