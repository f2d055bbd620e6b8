"""The contract between speculative workers and grammar engines.

Two classes: :class:`SpecGrammar` (one request's matcher state) and :class:`GrammarBackend`
(one per tokenizer: compiles specs, makes matchers). Adapters subclass both and implement the
underscored hooks; the public methods here check their inputs, keep the bookkeeping every
backend needs (accepted-token count, termination, rollback bound) and supply generic
fallbacks, so an adapter that only implements the required hooks is already complete.

Token bitmask layout: see :mod:`spec_grammar.bitmask`. Tree semantics: see
:mod:`spec_grammar.tree` and :func:`spec_grammar.traverse.fill_tree_bitmask_dfs`.
"""

from __future__ import annotations

import operator
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from .bitmask import bitmask_width, check_bitmask, clear_padding_bits
from .errors import (
    BitmaskError,
    GrammarCompileError,
    GrammarStateError,
    InvalidTokenError,
    SpecGrammarError,
    UnsupportedGrammarError,
)
from .json_schema.check import check_json_schema
from .json_schema.strict import KeywordSupport, unenforced_keywords
from .specs import GrammarSpec, JsonSchema, ToolCalls
from .tree import DraftTree

__all__ = [
    "TokenizerInfo",
    "Capabilities",
    "CompiledGrammar",
    "SpecGrammar",
    "GrammarBackend",
    "DEFAULT_MAX_ROLLBACK_TOKENS",
]

DEFAULT_MAX_ROLLBACK_TOKENS = 256
"""Default rollback depth: a draft tree's depth plus the tokens a delayed (overlapped) grammar
advance may need to undo, with ample margin."""


@dataclass(eq=False)
class TokenizerInfo:
    """What a backend needs to know about the tokenizer and the logits.

    Attributes:
        hf_tokenizer: the Hugging Face tokenizer.
        vocab_size: logits width ``V`` (columns of the model's logits; may exceed the tokenizer).
        tokenizer_vocab_size: ``len(tokenizer)``; ids in ``[tokenizer_vocab_size, V)`` are never
            allowed in a constrained row.
        stop_token_ids: tokens that end generation (EOS); allowed exactly where the grammar can end.
        special_token_ids: added/special tokens (never produced by a grammar, stop tokens aside).
    """

    hf_tokenizer: Any
    vocab_size: int
    tokenizer_vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_huggingface(
        cls,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> TokenizerInfo:
        """Build from a Hugging Face tokenizer. ``vocab_size`` = logits width (default
        ``len(tokenizer)``); ``stop_token_ids`` default to the tokenizer's EOS id.

        Raises ``ValueError`` when no stop token can be found or an id is out of range.
        """
        if not (hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "__len__")):
            raise TypeError(
                f"expected a Hugging Face tokenizer, got {type(tokenizer).__name__}"
                " (spec_grammar.models.load_tokenizer(name) loads one)"
            )
        n_tok = len(tokenizer)
        width = n_tok if vocab_size is None else int(vocab_size)
        if width <= 0:
            raise ValueError(f"vocab_size must be positive, got {width}")
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos)
        stops = tuple(int(t) for t in stop_token_ids)
        for t in stops:
            if not 0 <= t < min(n_tok, width):
                raise ValueError(
                    f"stop token id {t} is outside the vocabulary [0, {min(n_tok, width)})"
                )
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False):
                specials.add(int(i))
        return cls(
            hf_tokenizer=tokenizer,
            vocab_size=width,
            tokenizer_vocab_size=min(n_tok, width),
            stop_token_ids=stops,
            special_token_ids=frozenset(specials),
        )

    @property
    def bitmask_width(self) -> int:
        return bitmask_width(self.vocab_size)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """``token_bytes[i]``: the bytes of token ``i`` for ``i < tokenizer_vocab_size``."""
        from .vocab import token_bytes_table

        return token_bytes_table(self.hf_tokenizer, self.tokenizer_vocab_size)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the ids (invalid UTF-8 replaced); for error messages and reports."""
        return b"".join(
            self.token_bytes[t] if 0 <= t < self.tokenizer_vocab_size else b"" for t in token_ids
        ).decode("utf-8", errors="replace")


class Capabilities(BaseModel):
    """What a backend supports and which fast paths it has natively.

    The ``native_*`` flags say whether the library does the work itself; when False the adapter
    or the core emulates it (correct, maybe slower).
    """

    model_config = ConfigDict(frozen=True)

    json_schema: bool = True
    regex: bool = True
    ebnf: bool = False
    lark: bool = False
    tool_calls: bool = True
    native_rollback: bool = False
    native_fork: bool = False
    native_validate: bool = False
    native_tree_fill: bool = False
    native_forced_tokens: bool = False
    parallel_fill: bool = False
    releases_gil: bool = False


@dataclass(eq=False)
class CompiledGrammar:
    """A compiled grammar: the backend's own object plus where it came from.

    Attributes:
        spec: the spec it was compiled from.
        backend_name: name of the backend that compiled it (matchers check it).
        native: the library's compiled object (opaque to callers).
        compile_time_s: wall time of the compile in seconds (0 for a cache hit's original).
        warnings: one line per JSON-Schema keyword the backend compiled but does not enforce
            (see :mod:`spec_grammar.json_schema.strict`); empty when the grammar is enforced in full.
    """

    spec: GrammarSpec
    backend_name: str
    native: Any
    compile_time_s: float
    backend_id: int = 0
    warnings: tuple[str, ...] = ()


def _as_index(value: Any, what: str, error: type[Exception]) -> int:
    """``value`` as an exact int (Python or numpy/torch integer scalar); floats, strings and
    bools are refused with ``error`` rather than silently truncated."""
    if isinstance(value, bool):
        raise error(f"{what} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise error(
            f"{what} must be an integer, got {type(value).__name__} {value!r:.40}"
        ) from None


class SpecGrammar:
    """One request's grammar state, built for draft trees.

    Public methods check arguments and state, then call the adapter's hooks:

    Required hooks: ``_accept_token(t) -> bool`` (atomic: on False nothing changed),
    ``_rollback(k)``, ``_fork() -> SpecGrammar`` (same class, independent state),
    ``_fill_next_token_bitmask(bitmask, row)``, ``_is_terminated() -> bool``.

    Optional hooks (faster native paths; the defaults here are generic):
    ``_accept_tokens(ts) -> int``, ``_validate_tokens(ts) -> int``,
    ``_fill_tree_bitmask(tree, bitmask, row_offset) -> torch.Tensor``, ``_forced_tokens()``.

    Hooks only ever see token ids in ``[0, tokenizer_vocab_size)`` and are not called on a
    terminated matcher (except ``_rollback`` and ``_fork``).
    """

    def __init__(
        self, info: TokenizerInfo, *, max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS
    ):
        self.info = info
        self._max_rollback_tokens = int(max_rollback_tokens)
        self._num_accepted = 0
        self._stop_ids = frozenset(info.stop_token_ids)

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def max_rollback_tokens(self) -> int:
        """Deepest ``rollback(k)`` allowed: ``k`` above this (or above the number of accepted
        tokens) raises :class:`GrammarStateError`."""
        return self._max_rollback_tokens

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since the matcher was created (rollbacks subtract)."""
        return self._num_accepted

    def _check_token(self, token: int) -> int:
        t = _as_index(token, "token id", InvalidTokenError)
        if not 0 <= t < self.info.vocab_size:
            raise InvalidTokenError(
                f"token id {t} is outside the logits width [0, {self.info.vocab_size})"
            )
        return t

    # -- the protocol -------------------------------------------------------------------------
    def accept_token(self, token: int) -> bool:
        """Advance by one token. Returns False (state unchanged) when the grammar refuses it,
        when it is a padding id in ``[tokenizer_vocab_size, V)``, or once terminated.

        Raises :class:`InvalidTokenError` for ids outside ``[0, V)``.
        """
        t = self._check_token(token)
        if t >= self.info.tokenizer_vocab_size or self.is_terminated():
            return False
        ok = bool(self._accept_token(t))
        if ok:
            self._num_accepted += 1
        return ok

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Accept the longest acceptable prefix; stops at the first refusal, at a padding id
        (refused, as :meth:`accept_token` does) or at termination. Returns how many were
        accepted. Raises :class:`InvalidTokenError` (nothing accepted) if any id is outside
        ``[0, V)``."""
        v = self.info.vocab_size
        # plain in-range ints (the worker's runs) skip the per-token conversion
        if all(type(t) is int and 0 <= t < v for t in tokens):
            ts = list(tokens)
        else:
            ts = [self._check_token(t) for t in tokens]
        n_tok = self.info.tokenizer_vocab_size
        pad = next((k for k, t in enumerate(ts) if t >= n_tok), None)
        if pad is not None:
            ts = ts[:pad]
        if not ts or self.is_terminated():
            return 0
        n = self._accept_tokens(ts)
        self._num_accepted += n
        return n

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens :meth:`accept_tokens` would accept; the state is unchanged.
        Out-of-range ids (``-1`` padding, ``>= V``) end the prefix instead of raising."""
        ts = []
        for t in tokens:
            t = _as_index(t, "token id", InvalidTokenError)
            if not 0 <= t < self.info.tokenizer_vocab_size:
                break
            ts.append(t)
        if not ts or self.is_terminated():
            return 0
        return self._validate_tokens(ts)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens exactly, termination included.

        Raises :class:`GrammarStateError` when ``num_tokens`` is negative, exceeds
        :attr:`max_rollback_tokens`, or exceeds the tokens accepted so far.
        """
        k = _as_index(num_tokens, "rollback count", GrammarStateError)
        if k < 0:
            raise GrammarStateError(f"rollback({k}): the count must be >= 0")
        if k > self._max_rollback_tokens:
            raise GrammarStateError(
                f"rollback({k}) exceeds max_rollback_tokens={self._max_rollback_tokens}"
            )
        if k > self._num_accepted:
            raise GrammarStateError(
                f"rollback({k}) exceeds the {self._num_accepted} tokens accepted so far"
            )
        if k:
            self._rollback(k)
            self._num_accepted -= k

    def fork(self) -> SpecGrammar:
        """An independent copy (one per draft branch); it shares the compiled grammar."""
        child = self._fork()
        child._num_accepted = self._num_accepted
        child._max_rollback_tokens = self._max_rollback_tokens
        return child

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed set of the current state into ``bitmask[row]``.

        ``bitmask``: CPU ``(rows, ceil(V/32))`` int32, contiguous. Raises :class:`BitmaskError`
        on a bad buffer and :class:`GrammarStateError` on a terminated matcher.
        """
        row = _as_index(row, "bitmask row", BitmaskError)
        check_bitmask(bitmask, self.info.vocab_size, row)
        if self.is_terminated():
            raise GrammarStateError("fill_next_token_bitmask on a terminated matcher")
        self._fill_next_token_bitmask(bitmask, row)
        clear_padding_bits(bitmask, row, row + 1, self.info.tokenizer_vocab_size)

    def fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int = 0
    ) -> torch.Tensor:
        """Fill one row per tree node: row ``row_offset + n`` = tokens allowed after the path
        root..n. Returns ``valid``: ``(N,)`` bool, True for nodes whose token is allowed by
        their parent's row with every ancestor valid (the root is always valid).

        Rows of invalid nodes, of nodes below them and of nodes whose token terminated the
        grammar (a stop token) are all zero: nothing can be sampled from them. The matcher is
        exactly as before afterwards. Raises :class:`GrammarStateError` on a terminated
        matcher and :class:`BitmaskError` on a bad buffer.
        """
        if not isinstance(tree, DraftTree):
            raise TypeError(f"fill_tree_bitmask takes a DraftTree, got {type(tree).__name__}")
        row_offset = _as_index(row_offset, "row_offset", BitmaskError)
        check_bitmask(bitmask, self.info.vocab_size)
        if not 0 <= row_offset <= bitmask.shape[0] - tree.num_nodes:
            raise BitmaskError(
                f"rows [{row_offset}, {row_offset + tree.num_nodes}) do not fit a bitmask with "
                f"{bitmask.shape[0]} rows"
            )
        if self.is_terminated():
            raise GrammarStateError("fill_tree_bitmask on a terminated matcher")
        before = self._num_accepted
        valid = self._fill_tree_bitmask(tree, bitmask, row_offset)
        self._num_accepted = before
        clear_padding_bits(
            bitmask, row_offset, row_offset + tree.num_nodes, self.info.tokenizer_vocab_size
        )
        return valid

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""
        return bool(self._is_terminated())

    def is_stop_token(self, token: int) -> bool:
        return int(token) in self._stop_ids

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (jump-forward), possibly empty; never a stop
        token. The state is unchanged."""
        if self.is_terminated():
            return []
        return list(self._forced_tokens())

    # -- generic fallbacks (adapters may override) ------------------------------------------
    def _accept_tokens(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if self._is_terminated() or not self._accept_token(t):
                break
            n += 1
        return n

    def _validate_tokens(self, tokens: list[int]) -> int:
        n = self._accept_tokens(tokens)
        if n:
            self._rollback(n)
        return n

    def _fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        from .traverse import fill_tree_bitmask_dfs

        return fill_tree_bitmask_dfs(self, tree, bitmask, row_offset)

    def _forced_tokens(self) -> list[int]:
        from .traverse import forced_tokens_by_mask

        return forced_tokens_by_mask(self)

    # -- required hooks -----------------------------------------------------------------------
    def _accept_token(self, token: int) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rollback(self, num_tokens: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fork(self) -> SpecGrammar:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _is_terminated(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class _CompileCache:
    """LRU cache of compile results (grammars and errors) with in-flight deduplication: the
    first thread compiles, concurrent callers of the same key wait for its result."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._done: OrderedDict[str, CompiledGrammar | SpecGrammarError] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self.compiles = 0

    def get_or_compile(self, key: str, compile_fn) -> CompiledGrammar:
        with self._lock:
            hit = self._done.get(key)
            if hit is not None:
                self._done.move_to_end(key)
                owner = False
                fut = None
            else:
                fut = self._pending.get(key)
                owner = fut is None
                if owner:
                    fut = self._pending[key] = Future()
        if hit is not None:
            if isinstance(hit, BaseException):
                raise hit
            return hit
        if not owner:
            return fut.result()
        try:
            result: CompiledGrammar | SpecGrammarError = compile_fn()
        except SpecGrammarError as e:
            result = e
        except BaseException as e:  # never leave waiters hanging
            with self._lock:
                self._pending.pop(key, None)
            fut.set_exception(e)
            raise
        with self._lock:
            self.compiles += 1
            self._pending.pop(key, None)
            self._done[key] = result
            while len(self._done) > self.max_entries:
                self._done.popitem(last=False)
        if isinstance(result, BaseException):
            fut.set_exception(result)
            raise result
        fut.set_result(result)
        return result

    def __len__(self) -> int:
        return len(self._done)

    def clear(self) -> None:
        with self._lock:
            self._done.clear()


class GrammarBackend:
    """A grammar engine bound to one tokenizer.

    Subclasses set ``name`` and ``capabilities``, implement ``_compile(spec) -> native`` (raise
    :class:`GrammarCompileError` / :class:`UnsupportedGrammarError` with the reason) and
    ``_matcher(compiled) -> SpecGrammar``, and may override :meth:`library_version`.

    Args:
        tokenizer: a Hugging Face tokenizer.
        vocab_size: logits width when it differs from ``len(tokenizer)``.
        stop_token_ids: stop tokens (default: the tokenizer's EOS).
        max_rollback_tokens: rollback depth of every matcher this backend makes.
        compile_cache_size: compiled grammars (and compile errors) kept, least recently used
            evicted first.
        compile_timeout_s: a compile running longer fails with :class:`GrammarCompileError`
            (the library call cannot be interrupted: it finishes in a daemon thread and its
            result is dropped). ``None`` waits forever.
        max_grammar_bytes: specs whose serialized form is larger are refused before compiling.
    """

    name: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities] = Capabilities()
    json_schema_support: ClassVar[KeywordSupport] = KeywordSupport()
    """JSON-Schema keywords the library does not enforce (strict mode refuses them)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS,
        compile_cache_size: int = 256,
        compile_timeout_s: float | None = 60.0,
        max_grammar_bytes: int = 4_000_000,
    ):
        self.tokenizer_info = (
            tokenizer
            if isinstance(tokenizer, TokenizerInfo)
            else TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
            )
        )
        self.max_rollback_tokens = _as_index(max_rollback_tokens, "max_rollback_tokens", ValueError)
        if self.max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens must be >= 0, got {self.max_rollback_tokens}")
        if int(compile_cache_size) < 0:
            raise ValueError(
                f"compile_cache_size must be >= 0 (0 = no caching), got {compile_cache_size}"
            )
        self._cache = _CompileCache(int(compile_cache_size))
        self.compile_timeout_s = compile_timeout_s
        self.max_grammar_bytes = int(max_grammar_bytes)

    @classmethod
    def library_version(cls) -> str:
        """Version of the grammar library behind this backend."""
        return "unknown"

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    @property
    def num_compiles(self) -> int:
        """Compiles actually run (cache misses), for tests and reports."""
        return self._cache.compiles

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` (cached, thread-safe; concurrent compiles of one spec run once).

        Raises :class:`UnsupportedGrammarError` when this backend cannot represent the spec and
        :class:`GrammarCompileError` when the spec is invalid; library exceptions are wrapped.
        """
        if not isinstance(spec, GrammarSpec):
            raise TypeError(
                f"compile() takes a grammar spec (JsonSchema, Regex, ...), got {type(spec).__name__}"
            )
        if not getattr(self.capabilities, spec.kind, False):
            raise UnsupportedGrammarError(
                f"{spec.kind} grammars are not supported", backend=self.name
            )

        key = spec.cache_key()
        if len(key) > self.max_grammar_bytes:
            raise GrammarCompileError(
                f"the {spec.kind} spec is {len(key)} bytes, over max_grammar_bytes={self.max_grammar_bytes}",
                backend=self.name,
            )

        def run() -> CompiledGrammar:
            t0 = time.perf_counter()
            target = spec.to_json_schema() if isinstance(spec, ToolCalls) else spec
            ignored: list[str] = []
            try:
                if isinstance(target, JsonSchema):
                    check_json_schema(target.json_schema)
                    ignored = unenforced_keywords(target.json_schema, self.json_schema_support)
                    if ignored and target.strict:
                        raise UnsupportedGrammarError(
                            f"strict mode: {len(ignored)} keyword use(s) would not be enforced: "
                            + "; ".join(ignored[:5])
                            + ("; ..." if len(ignored) > 5 else "")
                        )
                native = self._compile_with_timeout(target)
            except SpecGrammarError as e:
                if isinstance(e, GrammarCompileError) and e.backend is None:
                    raise type(e)(str(e), backend=self.name, reason=e.reason) from e
                raise
            except Exception as e:  # library errors: RuntimeError, ValueError, ...
                # xgrammar prefixes "[hh:mm:ss] /path/file.cc:94: " and ends with blank lines
                reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()
                raise GrammarCompileError(
                    f"{spec.kind} failed to compile: {type(e).__name__}: {reason}",
                    backend=self.name,
                    reason=reason,
                ) from e
            return CompiledGrammar(
                spec, self.name, native, time.perf_counter() - t0, id(self), tuple(ignored)
            )

        return self._cache.get_or_compile(key, run)

    def _compile_with_timeout(self, spec: GrammarSpec) -> Any:
        if self.compile_timeout_s is None:
            return self._compile(spec)
        box: Future = Future()

        def target() -> None:
            try:
                box.set_result(self._compile(spec))
            except BaseException as e:
                box.set_exception(e)

        threading.Thread(target=target, name=f"{self.name}-compile", daemon=True).start()
        try:
            return box.result(timeout=self.compile_timeout_s)
        except TimeoutError:
            raise GrammarCompileError(
                f"{spec.kind} compile did not finish within compile_timeout_s={self.compile_timeout_s}"
            ) from None

    def matcher(self, compiled: CompiledGrammar) -> SpecGrammar:
        """A fresh matcher at the grammar's start state."""
        if not isinstance(compiled, CompiledGrammar) or compiled.backend_id != id(self):
            raise GrammarStateError(
                "this CompiledGrammar was not compiled by this backend instance"
            )
        return self._matcher(compiled)

    def fill_tree_bitmasks(
        self, jobs: Sequence[tuple[SpecGrammar, DraftTree, int]], bitmask: torch.Tensor
    ) -> list[torch.Tensor]:
        """Fill the tree rows of many requests: ``jobs`` = ``(matcher, tree, row_offset)``.
        Returns each job's ``valid`` tensor. Backends with a parallel executor override this."""
        return [m.fill_tree_bitmask(tree, bitmask, off) for m, tree, off in jobs]

    # -- hooks ------------------------------------------------------------------------------
    def _compile(self, spec: GrammarSpec) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _matcher(self, compiled: CompiledGrammar) -> SpecGrammar:  # pragma: no cover - abstract
        raise NotImplementedError
