"""llguidance adapter for spec-grammar.

Native paths used: ``LLMatcher.rollback`` / ``deep_copy``, ``validate_tokens`` (a cheap upper
bound and refusal test, see below), ``compute_ff_tokens`` for forced tokens,
``unsafe_compute_mask_ptr`` for rows (it releases the GIL, so the draft trees of many requests
fill on threads side by side). Tree rows come from a depth-first consume/rollback walk on the
native matcher (:mod:`.tree_walk`).

Three llguidance behaviours shape this adapter (notes/backend-libraries.md, llguidance 1.9.1):

- **Sticky error state (G4).** A refused ``consume_token`` or a too-deep ``rollback`` puts the
  matcher in an error state nothing clears. The native matcher is only ever given tokens whose
  bit is set in the row of its state.
- **Canonical-only masks in forced text.** Where the grammar forces text, llguidance's mask
  allows only the first token of that text's canonical tokenization (where ``{"a":`` must come
  next, the token ``{"a":`` but not ``{``), while its parser accepts every spelling. The
  protocol's row is the grammar's allowed set (as the other backends give it), so such a row
  is completed: when llguidance's row is a single token and forced bytes exist, every token
  consistent with the forced bytes that the parser accepts is added (:func:`complete_row`).
  Accept and validate then check the completed row, so "row allows t" <=> "accept(t)".
- **Stop tokens.** llguidance's ``is_stopped()`` is true right after the final ``}``, EOS
  consumed there is not recorded in the rollback history, and ``validate_tokens([EOS])``
  returns 0 there (G6). The adapter never hands a stop token to the native matcher: accepting
  an allowed stop token sets its own terminated flag, and ``rollback`` clears it.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spec_grammar.bitmask import check_bitmask, check_bitmask_rows
from spec_grammar.compile import LibraryResult
from spec_grammar.errors import (
    GrammarCompileError,
    GrammarLimitError,
    GrammarStateError,
    SpecGrammarError,
    UnsupportedGrammarError,
)
from spec_grammar.json_schema.limits import bound_numbers, out_of_range_number
from spec_grammar.json_schema.rewrite import ref_siblings_dropped, rewrite_patterns
from spec_grammar.json_schema.strict import NOT_CONTEXT_FREE_KEYWORDS, REMOTE_REF, KeywordSupport
from spec_grammar.protocol import Capabilities, CompiledGrammar, GrammarBackend, SpecGrammar
from spec_grammar.shared_native import PathNode, SharedNative
from spec_grammar.specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex
from spec_grammar.tree import DraftTree
from spec_grammar.vocab import tokenizer_len

try:
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark
except ImportError as e:  # pragma: no cover - exercised when the extra is missing
    raise ImportError("the llguidance backend needs `pip install llguidance`") from e

from .lexer import greedy_lexer_conflicts
from .probe import DEFAULT_MAX_ITEMS_IN_ROW, ROW_LIMIT, first_rows_fault, wide_object
from .rows import check_native, consume_native, fill_row
from .tree_walk import fill_trees, walk_tree
from .vocab import VocabIndex, llg_tokenizer

__all__ = ["LLGuidanceBackend", "LLGuidanceMatcher"]

_SEPARATORS = {"spaced": (", ", ": "), "compact": (",", ":")}

# Keywords a non-strict schema may have llguidance ignore (lenient mode), as xgrammar does;
# listed as library semantics in spec_grammar.testing.json_suite. Any other unimplemented
# keyword is refused even when not strict, since ignoring it would accept invalid documents.
# Unknown ``format`` values are always ignored when not strict (JSON Schema annotations).
_IGNORABLE_KEYWORDS = frozenset({"uniqueItems"})

_MAX_FRACTION_DIGITS = 10
"""The smallest ``multipleOf`` llguidance 1.9.1 takes is ``1e-10`` (``1e-11`` and below: "Value
for 'multipleOf' has too many digits"), so ``max_digits`` bounds fractions to at most 10."""

_PATTERN_WHY = (
    "is not enforced: llguidance 1.9 has no equivalent for this construct (the pattern is left out)"
)

# Warnings of llguidance that need no compile warning: an unknown `format` is ignored, as Draft
# 2020-12 makes `format` an annotation (the oracle's reading too).
_NO_WARNING = re.compile(r"^Unknown format: ")

# llguidance messages for valid input it cannot represent (as opposed to invalid input).
_EXCERPT = re.compile(r"^\s*(\^+|\d+ \|.*)\s*$")
"""A caret marker line or a numbered source excerpt (``   1 | start: /(a/``) of llguidance's
errors."""


def _one_line(text: str) -> str:
    """llguidance's error text on one line (errors are one line here, as the CLI prints them):
    caret markers and source excerpts dropped, the other lines joined. ``regex parse
    error:\n    (a\n    ^\nerror: unclosed group`` -> ``regex parse error: (a error: unclosed
    group``."""
    return " ".join(ln.strip() for ln in text.splitlines() if ln.strip() and not _EXCERPT.match(ln))


_LIMIT = re.compile(r"too big|too many|TooComplex|limit for this grammar|fuel", re.IGNORECASE)
"""llguidance's messages for a grammar past its ``LLParserLimits``."""

_TEXT_DEPTH = re.compile(r"recursion limit exceeded", re.IGNORECASE)
"""serde_json's message for text nested past its limit (128 levels, llguidance's own wrapper
of a JSON schema included)."""

NATIVE_TEXT_DEPTH = 124
"""The deepest JSON schema text llguidance 1.9.1 reads (:func:`~spec_grammar.limits.json_nesting_depth`
of the text: arrays nested 123 deep around a string compile, 124 deep are refused by
serde_json), below the default ``max_nesting_depth``; past it the compile is refused with
:class:`GrammarLimitError`."""

_UNSUPPORTED = re.compile(
    r"Unimplemented keys|not supported|Unknown format|not present in a registry", re.IGNORECASE
)


def _lexer_notes(lark: str) -> list[str]:
    """Compile warnings for the literal pairs where llguidance's greedy lexer may refuse valid
    text (:func:`~.lexer.greedy_lexer_conflicts`), one line each."""
    return [
        f"lexer:refuses at /: llguidance 1.9 lexes greedily and does not go back: {c}, so "
        "text with the shorter literal followed by that terminal is refused"
        for c in greedy_lexer_conflicts(lark)
    ]


@dataclass(eq=False)
class _Grammar:
    """A compiled grammar: llguidance's grammar string plus a matcher at the start state that
    new matchers are deep-copied from (a copy is ~1 µs, a fresh ``LLMatcher`` ~1 ms)."""

    text: str
    prototype: Any
    lock: threading.Lock = field(default_factory=threading.Lock)

    def new_matcher(self) -> Any:
        with self.lock:
            return self.prototype.deep_copy()


def _native_accept(m: Any, token: int) -> bool:
    return bool(m.consume_token(token)) and not m.is_error()


def _native_rollback(m: Any, k: int) -> None:
    if not (m.rollback(k) and not m.is_error()):
        raise GrammarStateError(f"llguidance rollback({k}) failed: {m.get_error()}")


def _native_copy(m: Any) -> Any:
    return m.deep_copy()


class LLGuidanceMatcher(SpecGrammar):
    """:class:`SpecGrammar` over ``llguidance.LLMatcher`` (see the module docstring for rows,
    stop tokens and the error state).

    The library matcher is shared with this matcher's forks (:mod:`spec_grammar.shared_native`):
    llguidance's ``deep_copy`` copies every token consumed so far, so a fork here is O(1) and
    the library matcher is moved (rollback + replay) to whichever view is used. ``shared`` /
    ``node``: the view's place when it is a fork (left out: a new shared native over
    ``matcher``)."""

    def __init__(
        self,
        backend: LLGuidanceBackend,
        matcher: Any = None,
        *,
        terminated: bool = False,
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
        self._terminated = terminated
        self._scratch: np.ndarray | None = None

    # -- helpers ------------------------------------------------------------------------------
    def _enter(self) -> Any:
        """The library matcher, moved to this view (the caller holds ``self._shared.lock``)."""
        self._shared, self._node = self._shared.enter(self._node)
        return self._shared.native

    @property
    def _m(self) -> Any:
        """The library matcher at this view's state (valid until another view is used)."""
        with self._shared.lock:
            return self._enter()

    def _consume(self, m: Any, token: int) -> None:
        """Consume an allowed ``token`` on ``m`` (this view's library matcher) and record it."""
        consume_native(m, token)
        self._node = self._shared.pushed(self._node, token)

    def _row(self, m: Any) -> np.ndarray:
        """The row of ``m``'s state (this view's library matcher) in a per-matcher ``(W,)``
        int32 buffer."""
        if self._scratch is None:
            self._scratch = np.zeros(self.info.bitmask_width, dtype=np.int32)
        fill_row(m, self._scratch, self._backend.vocab_index)
        return self._scratch

    def _allows(self, m: Any, token: int) -> bool:
        return bool((int(self._row(m)[token >> 5]) >> (token & 31)) & 1)

    # -- required hooks -----------------------------------------------------------------------
    def _accept_token(self, token: int) -> bool:
        with self._shared.lock:
            m = self._enter()
            # The parser's verdict is cheap and wider than the row: it settles refusals
            # without filling a row.
            if not self.is_stop_token(token) and m.validate_tokens([token]) != 1:
                return False
            if not self._allows(m, token):
                return False
            if self.is_stop_token(token):
                self._terminated = True
            else:
                self._consume(m, token)
            return True

    def _rollback(self, num_tokens: int) -> None:
        if self._terminated:
            # The stop token never reached the native matcher.
            self._terminated = False
            num_tokens -= 1
        # the library matcher follows when this view is next used
        self._node = self._shared.up(self._node, num_tokens)

    def _fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(
            self._backend, terminated=self._terminated, shared=self._shared, node=self._node
        )

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        with self._shared.lock:
            fill_row(self._enter(), bitmask.numpy()[row], self._backend.vocab_index)

    def _is_terminated(self) -> bool:
        return self._terminated

    # -- faster paths -------------------------------------------------------------------------
    def _validate_tokens(self, tokens: list[int]) -> int:
        # llguidance's count bounds the walk (its parser accepts every row token); the exact
        # count checks each token against its state's row.
        stop_at = next((i for i, t in enumerate(tokens) if self.is_stop_token(t)), len(tokens))
        with self._shared.lock:
            m = self._enter()
            bound = m.validate_tokens(tokens[:stop_at]) if stop_at else 0
            if bound == stop_at < len(tokens):
                bound += 1  # the stop token, checked against the row below
            n = consumed = 0
            try:
                while n < bound and self._allows(m, tokens[n]):
                    n += 1
                    if n > stop_at:
                        break
                    consume_native(m, tokens[n - 1])
                    consumed += 1
            finally:
                if consumed:
                    m.rollback(consumed)
            return n

    def _forced_tokens(self) -> list[int]:
        # The forced bytes are tokenized here, cut to what max_forced_tokens tokens can hold:
        # llguidance's compute_ff_tokens tokenizes all of them, and each kept token fills a row,
        # so a grammar forcing 100,000 bytes took 2 minutes (quadratic) and a longer run more.
        # A token is kept only if its row allows it and no token allowed there is a longer
        # spelling starting with it (then the model could write more in one token); stop
        # tokens are never forced.
        limit = self.max_forced_tokens
        vocab = self._backend.vocab_index
        token_bytes = self.info.token_bytes
        forced: list[int] = []
        with self._shared.lock:
            m = self._enter()
            ff = m.compute_ff_bytes()
            check_native(m)
            if not ff or limit <= 0:
                return []
            cut = ff[: limit * vocab.max_token_bytes]
            candidates = self._backend._llg_tokenizer.tokenize_bytes(cut)[:limit]
            try:
                for t in candidates:
                    if self.is_stop_token(t) or not self._allows(m, t):
                        break
                    row = self._scratch
                    longer = (
                        u
                        for u, b in vocab.starting_with(token_bytes[t])
                        if len(b) > len(token_bytes[t])
                    )
                    if any((int(row[u >> 5]) >> (u & 31)) & 1 for u in longer):
                        break
                    consume_native(m, t)
                    forced.append(t)
            finally:
                if forced:
                    m.rollback(len(forced))
        return forced

    def _fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        with self._shared.lock:
            return self._fill_tree_walk(self._enter(), tree, bitmask, row_offset, True)

    def _fill_tree_rows(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        with self._shared.lock:
            return self._fill_tree_walk(self._enter(), tree, bitmask, row_offset, False)

    def _fill_tree_walk(
        self, m: Any, tree: DraftTree, bitmask: torch.Tensor, row_offset: int, zero_dead: bool
    ) -> torch.Tensor:
        """:func:`~.tree_walk.walk_tree` (a stop-token child is valid with a dead row and is
        never consumed). Same rows as :func:`spec_grammar.traverse.fill_tree_bitmask_dfs`
        (dead rows zeroed when ``zero_dead``, else left as they were)."""
        words = bitmask.numpy()
        valid = walk_tree(
            m,
            tree,
            words,
            row_offset,
            self.info.tokenizer_vocab_size,
            self._stop_ids,
            self._backend.vocab_index,
        )
        if zero_dead:
            tokens, stops = tree.token_list, self._stop_ids
            dead = [
                row_offset + k for k, ok in enumerate(valid) if not ok or (k and tokens[k] in stops)
            ]
            if dead:
                words[dead] = 0
        return torch.from_numpy(np.array(valid, dtype=bool))


class LLGuidanceBackend(GrammarBackend):
    """llguidance (https://github.com/guidance-ai/llguidance) behind the spec-grammar protocol.

    Extra options: ``num_threads``, the threads that walk many requests' draft trees side by
    side in :meth:`fill_tree_bitmasks` (default: llguidance's executor rule, 80 % of the CPUs
    up to 32; with one thread the requests are walked one after another); ``slices`` for the tokenizer's mask slicer
    (``None`` = llguidance's general slices, ``[]`` = off; see G5); ``parser_limits``, keyword
    arguments of ``llguidance.LLParserLimits`` (lexer states, lexer fuel, Earley items per step,
    grammar size; default: the library's), which bound a compile's and a mask's time and memory:
    a grammar past them raises :class:`GrammarLimitError`.

    Raises ``ValueError`` when the tokenizer is not a fast Hugging Face tokenizer or when the
    logits width is smaller than the tokenizer (llguidance needs ``vocab_size >= len(tokenizer)``).
    """

    name = "llguidance"
    library_requirement = "llguidance>=1.9"  # the oldest release tested (the extra's pin)
    # llguidance 1.9.1 segfaults on a $ref chain of 1,000 object links (nesting 3,003; 600
    # links, 1,803, compile) or 3,000 bare links ({"$ref": next}: 3,003; 2,000 compile), and on
    # a chain of 5,000 rule references (2,000 compile), SmolLM2, main thread and compile thread
    native_max_nesting_depth = 1000
    capabilities = Capabilities(
        json_schema=True,
        regex=True,
        ebnf=True,
        lark=True,
        tool_calls=True,
    )
    # max_whitespace: a whitespace_pattern of bounded runs; max_digits: numeric bounds plus
    # multipleOf 10**-d (bound_numbers), which llguidance writes as digit ranges
    output_limits = frozenset({"max_whitespace", "max_digits"})
    # Measured on the JSON-Schema-Test-Suite (tests/test_reliability_strict.py).
    json_schema_support = KeywordSupport(
        unenforced={
            **dict.fromkeys(
                NOT_CONTEXT_FREE_KEYWORDS,
                "not enforced by llguidance 1.9 (refused when not lenient, ignored when lenient)",
            ),
            "uniqueItems": "llguidance 1.9 ignores uniqueItems (not context-free)",
            "oneOf": "llguidance 1.9 treats oneOf as anyOf unless the branches are provably disjoint",
            REMOTE_REF: "llguidance 1.9 resolves only local '#/...' references",
        },
        restricted={
            "format": (
                "llguidance 1.9 asserts the formats it knows, where Draft 2020-12 makes `format` an "
                "annotation: strings off the format are refused"
            )
        },
    )

    def __init__(
        self,
        tokenizer: Any,
        *,
        num_threads: int | None = None,
        slices: Sequence[str] | None = None,
        parser_limits: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(tokenizer, **kwargs)
        # the library's own resource limits (lexer states, fuel, Earley items per step): its
        # defaults unless given; a grammar past them is a GrammarLimitError at compile
        self._limits = None if parser_limits is None else llguidance.LLParserLimits(**parser_limits)
        info = self.tokenizer_info
        n_tok = tokenizer_len(info.hf_tokenizer)
        if info.tokenizer_vocab_size < n_tok:
            raise ValueError(
                f"llguidance needs a logits width >= the tokenizer's {n_tok} tokens, "
                f"got vocab_size={info.vocab_size}"
            )
        self._llg_tokenizer = llg_tokenizer(info, None if slices is None else list(slices))
        self._vocab_index: VocabIndex | None = None
        self._token_lengths: np.ndarray | None = None  # (V,) bytes per token, for the probe
        cpus = os.cpu_count() or 1
        self.num_threads = int(num_threads) if num_threads else max(1, min(32, cpus * 4 // 5))
        self._fill_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lazy_lock = threading.Lock()
        self._notes = threading.local()  # rewrite warnings of the compile running in this thread

    @classmethod
    def library_version(cls) -> str:
        return importlib.metadata.version("llguidance")

    # -- compile ------------------------------------------------------------------------------
    def _grammar_text(self, spec: GrammarSpec) -> str:
        if isinstance(spec, JsonSchema):
            flexible = spec.whitespace == "flexible"
            item_sep, key_sep = _SEPARATORS.get(spec.whitespace, (",", ":"))
            limits = spec.limits
            runs = limits.max_whitespace if limits is not None and flexible else None
            # overrides: the spec's whitespace policy wins over a schema's own x-guidance;
            # bounded runs are a pattern between tokens (flexible is then the pattern itself)
            options = {
                "whitespace_flexible": flexible and runs is None,
                "whitespace_pattern": None if runs is None else rf"[\x20\x0A\x0D\x09]{{0,{runs}}}",
                "item_separator": item_sep,
                "key_separator": key_sep,
                "lenient": not spec.strict,
            }
            # llguidance applies options only to object schemas: `true` is spelled `{}`.
            schema = "{}" if spec.json_schema is True else spec.schema_json()
            if spec.json_schema is not True:
                # llguidance searches with ASCII \d \w \s; the translation spells out Python's
                # classes (what jsonschema checks) and anchors the whole alternation
                digits = limits.max_digits if limits is not None else None
                fraction = None if digits is None else min(digits, _MAX_FRACTION_DIGITS)
                dropped = ref_siblings_dropped(spec.json_schema)
                bounded = bound_numbers(dropped, digits, fraction=fraction)
                rewritten, notes = rewrite_patterns(
                    bounded, "value", anchor=True, why=_PATTERN_WHY, property_patterns=True
                )
                # said only where the schema has a number the fraction bound reaches (it
                # warned on every schema, a string-only one too)
                if (
                    digits is not None
                    and digits > _MAX_FRACTION_DIGITS
                    and bounded != bound_numbers(dropped, digits)
                ):
                    notes.append(
                        f"max_digits:refuses at /: llguidance 1.9 takes multipleOf down to 1e-10, so "
                        f"a fraction gets at most {_MAX_FRACTION_DIGITS} digits (max_digits={digits})"
                    )
                self._notes.notes = notes
                if rewritten is not spec.json_schema:
                    schema = json.dumps(rewritten, ensure_ascii=False)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if isinstance(spec, Regex):
            pattern = spec.pattern
            if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
                # grammar_from_regex drops a lone trailing backslash (`a\` was served as `a`)
                raise GrammarCompileError(
                    "regex failed to compile: it ends with an unfinished escape (a lone "
                    "trailing backslash)"
                )
            return llguidance.LLMatcher.grammar_from_regex(pattern)
        if isinstance(spec, Ebnf):
            text = spec.text
            if spec.root != "root":
                if re.search(r"(?m)^\s*root\s*::=", text):
                    raise UnsupportedGrammarError(
                        f"root={spec.root!r} but the grammar also defines a rule named 'root', "
                        "which llguidance's GBNF converter always starts from"
                    )
                text += f"\nroot ::= {spec.root}\n"
            try:
                lark = gbnf_to_lark(text)
            except Exception as e:  # the converter raises bare Exception
                raise GrammarCompileError(f"invalid GBNF grammar: {e}", reason=str(e)) from e
            self._notes.notes += _lexer_notes(lark)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if isinstance(spec, Lark):
            self._notes.notes += _lexer_notes(spec.text)
            return llguidance.LLMatcher.grammar_from_lark(spec.text)
        raise UnsupportedGrammarError(f"{spec.kind} is not supported by llguidance")

    @classmethod
    def _library_error_reason(cls, error: Exception) -> str:
        return _one_line(str(error))

    def _text_depth_error(self, spec: GrammarSpec, reason: str) -> GrammarLimitError:
        return GrammarLimitError(
            f"{spec.kind}: llguidance 1.9.1 reads JSON nested at most {NATIVE_TEXT_DEPTH} deep "
            f"(its serde_json: {reason[:120]}), below max_nesting_depth={self.max_nesting_depth}, "
            "which does not lift it: flatten the spec (move deep subschemas to $defs), or use "
            "xgrammar (or auto, which routes there)",
            backend=self.name,
            reason=f"JSON text nested past llguidance's depth {NATIVE_TEXT_DEPTH}: {reason[:120]}",
        )

    def _compile(self, spec: GrammarSpec) -> _Grammar | LibraryResult:
        self._notes.notes = []
        wide = out_of_range_number(spec.json_schema) if isinstance(spec, JsonSchema) else None
        if wide is not None:  # llguidance clamps such a bound to 64 bits: another language
            raise GrammarLimitError(
                f"json_schema: the {wide} is outside what llguidance 1.9 holds (integer bounds "
                "within 64 bits, numbers within a double's range): it would write a clamped "
                "number; use a smaller bound",
                backend=self.name,
                reason=f"number out of llguidance's range: {wide}",
            )
        try:
            text = self._grammar_text(spec)
        except ValueError as e:
            if _TEXT_DEPTH.search(str(e)):
                raise self._text_depth_error(spec, _one_line(str(e))) from e
            raise
        notes = list(self._notes.notes)
        prototype = llguidance.LLMatcher(
            self._llg_tokenizer, text, log_level=0, limits=self._limits
        )
        if prototype.is_error():
            reason = _one_line(prototype.get_error())
            if _TEXT_DEPTH.search(reason):
                raise self._text_depth_error(spec, reason)
            if _LIMIT.search(reason):
                raise GrammarLimitError(
                    f"{spec.kind} failed to compile: llguidance's parser limits refuse it "
                    f"({reason[:300]}); raise them with parser_limits or simplify the grammar",
                    reason=reason,
                )
            err = UnsupportedGrammarError if _UNSUPPORTED.search(reason) else GrammarCompileError
            raise err(f"{spec.kind} failed to compile: {reason}", reason=reason)
        self._probe_first_rows(spec, prototype)
        if isinstance(spec, JsonSchema):
            ignored = {
                key
                for w in prototype.get_grammar_warnings()
                for key in re.findall(r'"([^"]+)"', w.partition("Unimplemented keys:")[2])
            } - _IGNORABLE_KEYWORDS
            if ignored:
                raise UnsupportedGrammarError(
                    f"llguidance does not implement the keywords {sorted(ignored)}; ignoring them "
                    "would accept documents the schema rejects",
                    reason=f"Unimplemented keys: {sorted(ignored)}",
                )
            # every other warning the library gives becomes a compile warning (never dropped)
            notes += [
                f"library at /: llguidance {self.library_version()} warned {w!r}"
                for w in prototype.get_grammar_warnings()
                if "Unimplemented keys:" not in w and not _NO_WARNING.match(w)
            ]
        grammar = _Grammar(text, prototype)
        return LibraryResult(grammar, tuple(notes)) if notes else grammar

    def _probe_first_rows(self, spec: GrammarSpec, prototype: Any) -> None:
        """Raise :class:`GrammarLimitError` when a token the first rows allow is refused
        (:func:`~.probe.first_rows_fault`: llguidance's row limit, which its compile does not
        report), :class:`GrammarCompileError` for any other such refusal."""
        if self._token_lengths is None:
            lengths = np.zeros(self.vocab_size, dtype=np.int64)
            table = self.tokenizer_info.token_bytes
            lengths[: len(table)] = [len(b) for b in table]
            self._token_lengths = lengths
        if isinstance(spec, JsonSchema):
            limit = getattr(self._limits, "max_items_in_row", None) or DEFAULT_MAX_ITEMS_IN_ROW
            wide = wide_object(spec.json_schema, limit)
            if wide is not None:
                raise GrammarLimitError(
                    f"{spec.kind}: the object at {wide[0]} has {wide[1]} optional properties "
                    "before its first required one: llguidance's parser would pass its row "
                    f"limit there (about {4 * wide[1] + 7} items, max_items_in_row={limit}) and "
                    "fail the request at that point; raise it with "
                    "parser_limits={'max_items_in_row': N} or use fewer optional properties",
                    reason=f"max_items_in_row {limit} < about {4 * wide[1] + 7} items",
                )
        stops = frozenset(self.tokenizer_info.stop_token_ids)
        fault = first_rows_fault(prototype, self._token_lengths, stops)
        if fault is None:
            return
        reason = _one_line(fault).split("<state>")[0].strip()
        if ROW_LIMIT.search(reason):
            raise GrammarLimitError(
                f"{spec.kind}: llguidance compiled it, but its parser passes its row limit at the "
                f"first tokens ({reason[:200]}): every request would fail there; raise the limit "
                "with parser_limits={'max_items_in_row': N} or use fewer optional properties per "
                "object",
                reason=reason,
            )
        raise GrammarCompileError(
            f"{spec.kind}: llguidance's first rows allow a token its parser refuses ({reason[:200]})",
            reason=reason,
        )

    def _export_native(self, native: _Grammar) -> str:
        # an LLMatcher does not pickle: the child checked the grammar (errors, limits,
        # warnings) and the parent builds its prototype again from the text (lazily: cheap)
        return native.text

    def _import_native(self, payload: str) -> _Grammar:
        return _Grammar(
            payload,
            llguidance.LLMatcher(self._llg_tokenizer, payload, log_level=0, limits=self._limits),
        )

    def _matcher(self, compiled: CompiledGrammar) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self, compiled.native.new_matcher())

    @property
    def vocab_index(self) -> VocabIndex:
        """Token bytes sorted for prefix queries (built on first use, under a lock)."""
        if self._vocab_index is not None:
            return self._vocab_index
        with self._lazy_lock:
            if self._vocab_index is None:
                self._vocab_index = VocabIndex(self.tokenizer_info)
            return self._vocab_index

    # -- many requests at once ---------------------------------------------------------------
    def fill_tree_bitmasks(
        self,
        jobs: Sequence[tuple[SpecGrammar, DraftTree, int]],
        bitmask: torch.Tensor,
        *,
        zero_dead_rows: bool = True,
    ) -> list[torch.Tensor]:
        """Fill the tree rows of many requests, ``jobs`` = ``(matcher, tree, row_offset)``; rows
        and the returned ``(N,)`` bool ``valid`` tensors are exactly those of
        :meth:`SpecGrammar.fill_tree_bitmask` per job (``zero_dead_rows`` as there).

        One batched pass (:func:`~.tree_walk.fill_trees`): every job's library matcher is
        moved to its state on the calling thread, then only the trees' depth-first walks run,
        spread over ``num_threads`` threads (llguidance's mask computation releases the GIL),
        then the dead rows and padding ids of the whole batch are settled in a few numpy passes.
        Jobs this pass cannot take (another backend's matcher, a subclass with its own tree
        fill, a second view of one library matcher) are filled one by one afterwards.

        Raises :class:`BitmaskError` on a bad buffer or rows that do not fit, and
        :class:`GrammarStateError` when a job's matcher is terminated or llguidance fails
        (the first failing job's error, once every other job is filled).
        """
        check_bitmask(bitmask, self.vocab_size)
        results: list[torch.Tensor | None] = [None] * len(jobs)
        batch: list[int] = []
        rest: list[int] = []
        errors: dict[int, BaseException] = {}
        seen: set[int] = set()
        for i, (m, tree, off) in enumerate(jobs):
            fits = (
                isinstance(m, LLGuidanceMatcher)
                # a subclass with its own tree fill is filled by it, not by the batch walk
                and type(m)._fill_tree_rows is LLGuidanceMatcher._fill_tree_rows
                and type(m)._fill_tree_bitmask is LLGuidanceMatcher._fill_tree_bitmask
                and m._backend is self
                and isinstance(tree, DraftTree)
                and id(m._shared) not in seen
                and isinstance(off, int)
                and not isinstance(off, bool)
            )
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
            seen.add(id(m._shared))  # views of one library matcher are filled one by one
            batch.append(i)
        if batch:
            self._fill_batch(batch, jobs, bitmask, zero_dead_rows, results, errors)
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
        batch: list[int],
        jobs: Sequence[tuple[SpecGrammar, DraftTree, int]],
        bitmask: torch.Tensor,
        zero_dead: bool,
        results: list[torch.Tensor | None],
        errors: dict[int, BaseException],
    ) -> None:
        """The batched pass of :meth:`fill_tree_bitmasks` over ``jobs[i]`` for ``i`` in
        ``batch`` (distinct library matchers of this backend): results and errors by job
        index."""
        # in id order (no deadlock with another batch); plain acquires: an ExitStack cost
        # ~4 us a job
        locks = sorted((jobs[i][0]._shared for i in batch), key=id)
        held = []
        try:
            for shared in locks:
                shared.lock.acquire()
                held.append(shared.lock)
            native = []
            for i in batch:
                m, tree, off = jobs[i]
                try:
                    native.append((i, (m._enter(), tree, off)))
                except Exception as e:  # noqa: BLE001  (a lost library matcher: this job fails)
                    errors[i] = e
            valids, failed = fill_trees(
                [job for _, job in native],
                bitmask,
                n_tok=self.tokenizer_info.tokenizer_vocab_size,
                stops=frozenset(self.tokenizer_info.stop_token_ids),
                vocab=self.vocab_index,
                zero_dead=zero_dead,
                submit=self._submit,
                threads=self.num_threads,
            )
        finally:
            for lock in held:
                lock.release()
        for k, (i, _) in enumerate(native):
            if k in failed:
                errors[i] = failed[k]
            else:
                results[i] = valids[k]

    def _submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the fill pool (``num_threads - 1`` threads, started on first use)."""
        with self._lazy_lock:
            if self._fill_pool is None or self._fill_pool._max_workers < self.num_threads - 1:
                if self._fill_pool is not None:
                    self._fill_pool.shutdown(wait=False)
                self._fill_pool = concurrent.futures.ThreadPoolExecutor(
                    max(1, self.num_threads - 1), thread_name_prefix="spec-grammar-llguidance-fill"
                )
            self._fill_pool.submit(fn)
