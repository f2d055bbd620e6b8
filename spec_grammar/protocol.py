"""The contract between speculative workers and grammar engines.

:class:`SpecGrammar` (one request's matcher state) and :class:`GrammarBackend` (one per
tokenizer: compiles specs, makes matchers) are abstract: adapters implement the abstract
underscored hooks, and a class missing one cannot be instantiated. The public methods check
their inputs, keep the bookkeeping every backend needs (accepted-token count, termination,
rollback bound) and supply generic fallbacks for the optional hooks.

Defined in their own modules: :mod:`.tokenizer_info`, :mod:`.capabilities`, :mod:`.compile`
(the compile pipeline and :class:`CompiledGrammar`), :mod:`.bitmask` (the token bitmask
layout), :mod:`.tree` and :mod:`.traverse` (tree semantics, the generic tree fill).
"""

from __future__ import annotations

import math
import operator
import pickle
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .bitmask import check_bitmask, check_bitmask_rows, clear_padding_bits
from .capabilities import Capabilities, ConformanceCase
from .compile import CompileCache, CompiledGrammar, compile_spec
from .compile_worker import (
    DEFAULT_COMPILE_MEMORY_BYTES,
    CompilePool,
    check_memory_bytes,
    resolve_isolation,
)
from .errors import BitmaskError, GrammarStateError, InvalidTokenError
from .json_schema.strict import KeywordSupport
from .limits import DEFAULT_MAX_GRAMMAR_BYTES
from .nesting import DEFAULT_MAX_NESTING_DEPTH
from .specs import GrammarSpec
from .tokenizer_info import TokenizerInfo
from .traverse import fill_tree_bitmask_dfs, forced_tokens_by_mask
from .tree import DraftTree

__all__ = [
    "TokenizerInfo",
    "Capabilities",
    "ConformanceCase",
    "CompiledGrammar",
    "SpecGrammar",
    "GrammarBackend",
    "DEFAULT_MAX_ROLLBACK_TOKENS",
    "DEFAULT_MAX_FORCED_TOKENS",
]

DEFAULT_MAX_ROLLBACK_TOKENS = 256
"""Default rollback depth: a draft tree's depth plus the tokens a delayed (overlapped) grammar
advance may need to undo, with ample margin."""

DEFAULT_MAX_FORCED_TOKENS = 64
"""Default of ``max_forced_tokens``: the most tokens one :meth:`SpecGrammar.forced_tokens`
returns (a draft tree takes far fewer; a grammar forcing a longer run gives it in pieces)."""


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


def _check_timeout(value: Any) -> float | None:
    """``compile_timeout_s`` checked: None or ``inf`` (wait for ever: None), else a number > 0.
    A bad limit is the caller's error, not the grammar's: unchecked, every compile would fail
    (and be cached) as a timeout or a "failed to compile" of a valid spec."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"compile_timeout_s must be None or a number of seconds > 0, got {value!r:.40}"
        )
    if value == math.inf:
        return None
    if not value > 0:  # NaN too
        raise ValueError(f"compile_timeout_s must be None or a number of seconds > 0, got {value}")
    return value


class SpecGrammar(ABC):
    """One request's grammar state, built for draft trees.

    Public methods check arguments and state, then call the adapter's hooks:

    Required hooks: ``_accept_token(t) -> bool`` (atomic: on False nothing changed),
    ``_rollback(k)``, ``_fork() -> SpecGrammar`` (same class, independent state),
    ``_fill_next_token_bitmask(bitmask, row)``, ``_is_terminated() -> bool``.

    Optional hooks (faster native paths; the defaults here are generic):
    ``_accept_tokens(ts) -> int``, ``_validate_tokens(ts) -> int``,
    ``_fill_tree_bitmask(tree, bitmask, row_offset) -> torch.Tensor``,
    ``_fill_tree_rows(tree, bitmask, row_offset) -> torch.Tensor`` (the same without writing
    the dead rows; default: ``_fill_tree_bitmask``), ``_forced_tokens()``.

    Hooks only ever see token ids in ``[0, tokenizer_vocab_size)`` and are not called on a
    terminated matcher (except ``_rollback`` and ``_fork``).
    """

    def __init__(
        self, info: TokenizerInfo, *, max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS
    ):
        self.info = info
        self._max_rollback_tokens = int(max_rollback_tokens)
        self.max_forced_tokens = DEFAULT_MAX_FORCED_TOKENS  # the backend's, set by matcher()
        self._num_accepted = 0
        self._stop_ids = frozenset(info.stop_token_ids)

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
        if not isinstance(n, bool) and hasattr(n, "__index__"):
            n = operator.index(n)
        if not (type(n) is int and 0 <= n <= len(ts)):  # the rollback bound counts on it
            raise GrammarStateError(
                f"{type(self).__name__}._accept_tokens returned {n!r} for {len(ts)} tokens: "
                f"it must return how many it accepted, an int in [0, {len(ts)}]"
            )
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
        """An independent copy (one per draft branch); it shares the compiled grammar. Raises
        :class:`GrammarStateError` when the adapter's ``_fork`` returns no new matcher."""
        child = self._fork()
        if not isinstance(child, SpecGrammar) or child is self:
            raise GrammarStateError(
                f"{type(self).__name__}._fork must return a new SpecGrammar, got "
                + ("the matcher itself" if child is self else type(child).__name__)
            )
        child._num_accepted = self._num_accepted
        child._max_rollback_tokens = self._max_rollback_tokens
        child.max_forced_tokens = self.max_forced_tokens
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
        self,
        tree: DraftTree,
        bitmask: torch.Tensor,
        row_offset: int = 0,
        *,
        zero_dead_rows: bool = True,
    ) -> torch.Tensor:
        """Fill one row per tree node: row ``row_offset + n`` = tokens allowed after the path
        root..n. Returns ``valid``: ``(N,)`` bool, True for nodes whose token is allowed by
        their parent's row with every ancestor valid (the root is always valid).

        Rows of invalid nodes, of nodes below them and of nodes whose token terminated the
        grammar (a stop token) are the *dead* rows: all zero (nothing can be sampled from
        them), or, with ``zero_dead_rows=False``, left unspecified for a caller that writes
        them itself (SGLang's hook sets them all-allowed: one write per row instead of two).
        The matcher is exactly as before afterwards. Raises ``TypeError`` when ``tree`` is not
        a :class:`DraftTree`, :class:`GrammarStateError` on a terminated matcher and
        :class:`BitmaskError` on a bad buffer.
        """
        if not isinstance(tree, DraftTree):
            raise TypeError(f"fill_tree_bitmask takes a DraftTree, got {type(tree).__name__}")
        row_offset = _as_index(row_offset, "row_offset", BitmaskError)
        check_bitmask(bitmask, self.info.vocab_size)
        check_bitmask_rows(bitmask, row_offset, tree.num_nodes)
        if self.is_terminated():
            raise GrammarStateError("fill_tree_bitmask on a terminated matcher")
        before = self._num_accepted
        if zero_dead_rows:
            valid = self._fill_tree_bitmask(tree, bitmask, row_offset)
        else:
            valid = self._fill_tree_rows(tree, bitmask, row_offset)
        self._num_accepted = before
        if not (
            isinstance(valid, torch.Tensor)
            and valid.shape == (tree.num_nodes,)
            and valid.dtype == torch.bool
        ):
            raise GrammarStateError(
                f"{type(self).__name__}._fill_tree_bitmask must return a ({tree.num_nodes},) bool "
                f"tensor, got {type(valid).__name__} "
                f"{tuple(valid.shape) if isinstance(valid, torch.Tensor) else ''}"
                f"{valid.dtype if isinstance(valid, torch.Tensor) else ''}".rstrip()
            )
        clear_padding_bits(
            bitmask, row_offset, row_offset + tree.num_nodes, self.info.tokenizer_vocab_size
        )
        return valid

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""
        return bool(self._is_terminated())

    def is_stop_token(self, token: int) -> bool:
        """True for the tokenizer info's stop tokens."""
        return int(token) in self._stop_ids

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (jump-forward), possibly empty; never a stop
        token; at most :attr:`max_forced_tokens` (the first ones of a longer run: adapters
        stop their search there, so a grammar forcing a run of any length costs a bounded
        time and memory). The state is unchanged."""
        if self.is_terminated():
            return []
        return list(self._forced_tokens())[: self.max_forced_tokens]

    # -- required hooks -----------------------------------------------------------------------
    @abstractmethod
    def _accept_token(self, token: int) -> bool: ...

    @abstractmethod
    def _rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def _fork(self) -> SpecGrammar: ...

    @abstractmethod
    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def _is_terminated(self) -> bool: ...

    # -- optional hooks: generic fallbacks ----------------------------------------------------
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
        return fill_tree_bitmask_dfs(self, tree, bitmask, row_offset)

    def _fill_tree_rows(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        # what _fill_tree_bitmask does, dead rows left unwritten where the adapter can skip
        # them; zero rows are a correct default
        return self._fill_tree_bitmask(tree, bitmask, row_offset)

    def _forced_tokens(self) -> list[int]:
        return forced_tokens_by_mask(self, self.max_forced_tokens)


class GrammarBackend(ABC):
    """A grammar engine bound to one tokenizer.

    Subclasses set ``name``, ``capabilities`` and ``json_schema_support``, implement
    ``_compile(spec) -> native`` (raise :class:`GrammarCompileError` /
    :class:`UnsupportedGrammarError` with the reason) and ``_matcher(compiled) -> SpecGrammar``,
    and may override :meth:`library_version`, :meth:`fill_tree_bitmasks` and
    :meth:`_library_error_reason`.

    Args:
        tokenizer: a Hugging Face tokenizer (or a :class:`TokenizerInfo`).
        vocab_size: logits width when it differs from ``len(tokenizer)``.
        stop_token_ids: stop tokens (default: the tokenizer's EOS).
        max_rollback_tokens: rollback depth of every matcher this backend makes.
        compile_cache_size: compiled grammars (and compile errors) kept, least recently used
            evicted first.
        compile_timeout_s: a compile running longer fails with :class:`GrammarCompileError`
            (under ``isolation="process"`` its compile process is killed; under ``"thread"``
            the library call cannot be interrupted: it finishes in a daemon thread and its
            result is dropped). ``None`` (or ``inf``) waits forever.
        isolation: where ``_compile`` runs (:mod:`spec_grammar.compile_worker`):
            ``"process"``, a warm child process, killed at ``compile_timeout_s``, whose death
            (a native abort, the memory cap) is a typed error; ``"thread"``, a daemon thread
            of this process. None: the ``SPEC_GRAMMAR_ISOLATION`` environment variable, else
            the class's :attr:`compile_isolation`.
        compile_memory_bytes: the address space of a compile process (``RLIMIT_AS``; None:
            no cap); ``"process"`` isolation only.
        max_grammar_bytes: specs whose serialized form is larger are refused before compiling.
        max_nesting_depth: specs nested deeper (:func:`spec_grammar.nesting.nesting_depth`:
            JSON containers of a schema with local ``$ref`` expanded, groups of a regex or
            ``pattern``, brackets of Lark / GBNF rule bodies) are refused with
            :class:`GrammarLimitError` before compiling.
        max_forced_tokens: the most tokens a matcher's ``forced_tokens()`` returns (and
            searches for).

    Raises ``ValueError`` for a negative ``max_rollback_tokens``, ``compile_cache_size`` or
    ``max_forced_tokens``, a
    ``compile_timeout_s`` that is not None or a number > 0, a ``max_grammar_bytes`` or
    ``max_nesting_depth`` < 1, a count that is not an int, an ``isolation`` or
    ``compile_memory_bytes`` that :func:`~spec_grammar.compile_worker.resolve_isolation` /
    :func:`~spec_grammar.compile_worker.check_memory_bytes` refuse, and for tokenizer arguments
    :meth:`TokenizerInfo.from_huggingface` refuses.
    """

    name: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities] = Capabilities()
    json_schema_support: ClassVar[KeywordSupport] = KeywordSupport()
    """JSON-Schema keywords the library does not enforce (strict mode refuses them)."""
    output_limits: ClassVar[frozenset[str]] = frozenset()
    """The :class:`~spec_grammar.json_schema.limits.OutputLimits` fields ``_compile`` enforces
    itself from ``spec.limits`` (``max_digits``, ``max_whitespace``); the compile of a spec
    setting another of them carries a warning saying so."""
    schema_caps: ClassVar[frozenset[str]] = frozenset(
        {"max_string_length", "max_items", "closed_objects"}
    )
    """The output limits :func:`~spec_grammar.compile.compile_spec` writes into this backend's
    JSON schemas (:func:`~spec_grammar.json_schema.limits.cap_lengths`,
    :func:`~spec_grammar.json_schema.limits.close_objects`); a backend whose compile cost grows
    with a bound leaves it out, and the compile of a spec setting it carries a warning."""
    compile_isolation: ClassVar[str] = "thread"
    """Default ``isolation`` of the class: ``"process"`` for a library whose compile can abort
    the process or outlast its limit (measured: ``benchmarks/bench_compile_isolation.py``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> GrammarBackend:
        # the constructor's arguments, for a compile process to build the same backend
        self = super().__new__(cls)
        self._init_args = (args, kwargs)
        return self

    native_max_nesting_depth: ClassVar[int | None] = None
    """The deepest nesting (:func:`spec_grammar.nesting.nesting_depth`) the library survives,
    None = no known bound: a library that recurses on its native stack (a chain of ``$ref``
    or of rule references) aborts the process past it, so a deeper spec is refused before
    compiling whatever ``max_nesting_depth`` says (measured per adapter, with a margin)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS,
        compile_cache_size: int = 256,
        compile_timeout_s: float | None = 60.0,
        max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
        max_forced_tokens: int = DEFAULT_MAX_FORCED_TOKENS,
        max_nesting_depth: int = DEFAULT_MAX_NESTING_DEPTH,
        isolation: str | None = None,
        compile_memory_bytes: int | None = DEFAULT_COMPILE_MEMORY_BYTES,
    ):
        self.isolation = resolve_isolation(type(self), isolation)
        self.compile_memory_bytes = check_memory_bytes(compile_memory_bytes)
        self._compile_pool: CompilePool | None = None
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
        cache_size = _as_index(compile_cache_size, "compile_cache_size", ValueError)
        if cache_size < 0:
            raise ValueError(
                f"compile_cache_size must be >= 0 (0 = no caching), got {compile_cache_size}"
            )
        self._cache = CompileCache(cache_size)
        self.compile_timeout_s = _check_timeout(compile_timeout_s)
        self.max_grammar_bytes = _as_index(max_grammar_bytes, "max_grammar_bytes", ValueError)
        if self.max_grammar_bytes < 1:
            raise ValueError(f"max_grammar_bytes must be >= 1, got {max_grammar_bytes}")
        self.max_nesting_depth = _as_index(max_nesting_depth, "max_nesting_depth", ValueError)
        if self.max_nesting_depth < 1:
            raise ValueError(f"max_nesting_depth must be >= 1, got {max_nesting_depth}")
        self.max_forced_tokens = _as_index(max_forced_tokens, "max_forced_tokens", ValueError)
        if self.max_forced_tokens < 0:
            raise ValueError(f"max_forced_tokens must be >= 0, got {max_forced_tokens}")
        if self.isolation == "process":
            # started now, so the first compile finds a warm child (a subclass whose own
            # __init__ then fails drops the pool with the object)
            try:
                self._compile_pool = CompilePool(self, self.compile_memory_bytes)
            except (TypeError, AttributeError, pickle.PicklingError) as e:
                if isolation is not None:
                    raise ValueError(
                        f"isolation='process' needs constructor arguments that pickle (a "
                        f"compile process builds the backend from them): {e}"
                    ) from e
                self.isolation = "thread"  # the default, where it cannot apply
            else:
                weakref.finalize(self, self._compile_pool.close)

    @property
    def compile_pool(self) -> CompilePool | None:
        """The warm compile processes of ``isolation="process"``
        (:class:`~spec_grammar.compile_worker.CompilePool`), else None."""
        return self._compile_pool

    library_requirement: str | None = None
    """The grammar library and the oldest release the adapter works with, as a pip requirement
    ``"name>=X.Y.Z"`` (None: not checked). :func:`~spec_grammar.registry.load_backend_class`
    refuses the backend when :meth:`library_version` is older."""

    @classmethod
    def conformance_cases(cls, fixture: str) -> Sequence[ConformanceCase]:
        """Grammars (with complete documents) the conformance suite tests this backend on,
        next to its own grammars of the kinds claimed in whole, on fixture tokenizer
        ``fixture`` (``"toy"``: the suite's 20-token vocabulary; ``"smollm2"``). A backend
        claiming a kind only in part (:attr:`Capabilities.subsets
        <spec_grammar.capabilities.Capabilities.subsets>`) is tested on its kind through
        these. Default: none."""
        return ()

    @classmethod
    def library_version(cls) -> str:
        """Version of the grammar library behind this backend."""
        return "unknown"

    @property
    def vocab_size(self) -> int:
        """Logits width ``V``."""
        return self.tokenizer_info.vocab_size

    @property
    def num_compiles(self) -> int:
        """Compiles actually run (cache misses), for tests and reports."""
        return self._cache.compiles

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` (cached, thread-safe; concurrent compiles of one spec run once).

        Raises ``TypeError`` when ``spec`` is not a grammar spec,
        :class:`UnsupportedGrammarError` when this backend cannot represent the spec and
        :class:`GrammarCompileError` when the spec is invalid; library exceptions are wrapped.
        Steps: :func:`spec_grammar.compile.compile_spec`.
        """
        return compile_spec(self, spec)

    def matcher(self, compiled: CompiledGrammar) -> SpecGrammar:
        """A fresh matcher at the grammar's start state: of the grammar compiled, so for a
        tagged :class:`~spec_grammar.specs.ToolCalls` grammar the matcher of one call (the
        request's composite is :func:`spec_grammar.compose.matcher`'s work). Raises
        :class:`GrammarStateError` for a grammar another backend instance compiled."""
        if not isinstance(compiled, CompiledGrammar) or compiled.backend_id != id(self):
            raise GrammarStateError(
                "this CompiledGrammar was not compiled by this backend instance"
            )
        return self._checked_matcher(compiled)

    def _checked_matcher(self, compiled: CompiledGrammar) -> SpecGrammar:
        m = self._matcher(compiled)
        if not isinstance(m, SpecGrammar):  # a library matcher would skip every check here
            raise GrammarStateError(
                f"{type(self).__name__}._matcher must return a SpecGrammar, got {type(m).__name__}"
            )
        m.max_forced_tokens = self.max_forced_tokens
        return m

    def fill_tree_bitmasks(
        self,
        jobs: Sequence[tuple[SpecGrammar, DraftTree, int]],
        bitmask: torch.Tensor,
        *,
        zero_dead_rows: bool = True,
    ) -> list[torch.Tensor]:
        """Fill the tree rows of many requests: ``jobs`` = ``(matcher, tree, row_offset)``.
        Returns each job's ``valid`` tensor; rows and ``zero_dead_rows`` as
        :meth:`SpecGrammar.fill_tree_bitmask`. Backends with a parallel executor override
        this."""
        return [
            m.fill_tree_bitmask(tree, bitmask, off, zero_dead_rows=zero_dead_rows)
            for m, tree, off in jobs
        ]

    # -- hooks ------------------------------------------------------------------------------
    @abstractmethod
    def _compile(self, spec: GrammarSpec) -> Any: ...

    @abstractmethod
    def _matcher(self, compiled: CompiledGrammar) -> SpecGrammar: ...

    def _export_native(self, native: Any) -> Any:
        """What a compile process sends back for ``_compile``'s ``native`` (picklable; default:
        the object itself); :meth:`_import_native` rebuilds it in this process."""
        return native

    def _import_native(self, payload: Any) -> Any:
        """The native object of :meth:`_export_native`'s ``payload`` (default: itself)."""
        return payload

    @classmethod
    def _library_error_reason(cls, error: Exception) -> str:
        """The reason to report for an exception the library raised while compiling (the
        ``reason`` of the :class:`GrammarCompileError` wrapping it). Adapters whose library
        decorates its messages (log prefixes) override this to strip the decoration."""
        return str(error).strip()
