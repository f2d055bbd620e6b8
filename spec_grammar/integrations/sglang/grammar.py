"""SGLang grammar backend and per-request grammar objects over any spec-grammar backend.

SGLang (``sglang.srt.constrained.base_grammar_backend``) asks two things of a grammar
backend: a per-process :class:`BaseGrammarBackend` whose ``dispatch_json / regex / ebnf /
structural_tag`` compile a request's grammar (SGLang caches the result and hands each request
``copy()`` of it), and per-request :class:`BaseGrammarObject` s that the scheduler advances with
``accept_token`` and the speculative workers walk over the draft tree with
``accept_token`` / ``rollback`` / ``fill_vocab_mask``. Here both delegate to spec-grammar:
:class:`SGLangGrammarBackend` wraps a :class:`~spec_grammar.protocol.GrammarBackend` (any
registered one), :class:`SGLangGrammar` wraps one request's
:class:`~spec_grammar.protocol.SpecGrammar`.

Differences from SGLang's built-in objects (its xgrammar / llguidance / outlines wrappers):
``rollback(k)`` is O(k) and reaches the backend's ``max_rollback_tokens`` (256 by default,
SGLang's xgrammar matcher: 200), it undoes termination too, and every backend rolls back
(SGLang's outlines object cannot, so outlines-core serves speculative decoding only here);
``accept_token`` raises ``ValueError`` on any refused token, also after termination (SGLang's
xgrammar object ignores tokens once terminated); masks are always the packed int32 layout
(bit set = allowed), allocated all-allowed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import os
import sys
from array import array
from typing import Any

import torch
from sglang.srt.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarStats,
    InvalidGrammarObject,
)

from spec_grammar.compose import matcher as compose_matcher

from ...bitmask import bitmask_width
from ...errors import GrammarCompileError, GrammarStateError, SpecGrammarError
from ...kernels import apply_token_bitmask_inplace
from ...protocol import CompiledGrammar, GrammarBackend, SpecGrammar
from ...registry import get_backend
from ...specs import Ebnf, GrammarSpec, JsonSchema, Regex
from ..post_check import log_if_invalid, needs_check, strict_from_env

logger = logging.getLogger(__name__)

STRICT_ENV = "SPEC_GRAMMAR_SGLANG_STRICT"
"""The older name of :data:`~spec_grammar.integrations.post_check.STRICT_ENV`
(``SPEC_GRAMMAR_STRICT``), still read: ``1`` compiles every JSON schema in strict mode (a
schema using a keyword the backend would not enforce is rejected, the request aborted, instead
of served with a logged warning and its output checked)."""


def allocate_mask(vocab_size: int, rows: int, device: Any = "cpu") -> torch.Tensor:
    """An uninitialized ``(rows, ceil(vocab_size / 32))`` int32 mask on ``device``, pinned on
    the host when CUDA is present (the tree fill writes every row itself)."""
    dev = torch.device(device)
    pin = dev.type == "cpu" and torch.cuda.is_available()
    return torch.empty(
        (rows, bitmask_width(vocab_size)), dtype=torch.int32, device=dev, pin_memory=pin
    )


class SGLangGrammar(BaseGrammarObject):
    """One request's grammar state for SGLang, delegating to a spec-grammar matcher.

    Args:
        backend: the spec-grammar backend that made ``matcher`` (its batched tree fill serves
            every request of the batch at once).
        matcher: the request's :class:`SpecGrammar` (owned by this object).
        compiled: the grammar it runs (kept for ``repr``).
        grammar_stats: SGLang's per-request statistics record, or None.
        path: the tokens ``matcher`` has accepted (a fork's), default none.
        check: the request as written, when the backend left some of it unenforced: when
            SGLang marks the grammar :attr:`finished` after it terminated, the output
            (:attr:`path` detokenized) is checked and a violation logged as one WARNING line
            (:func:`~spec_grammar.integrations.post_check.log_if_invalid`); :attr:`valid`
            holds the verdict (None until then, or without ``check``).

    A matcher whose library failed (llguidance's reaching a state with no continuation, e.g.
    ``x ::= x`` after ``"a" x``; a batched fill that failed for another request of its group)
    raises :class:`~spec_grammar.errors.GrammarStateError` on every later use. SGLang catches
    only ``ValueError`` around ``accept_token`` and nothing around the mask fills, so here such
    a matcher is replaced by a fresh one replaying :attr:`path` (:meth:`recover`); a state
    that fails again allows no token (an all-zero row, as xgrammar gives a dead state) and
    SGLang aborts the request at its next ``accept_token``.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        matcher: SpecGrammar,
        compiled: CompiledGrammar,
        grammar_stats: GrammarStats | None = None,
        path: array | None = None,
        check: GrammarSpec | None = None,
    ):
        super().__init__()
        self.backend = backend
        self.matcher = matcher
        self.compiled = compiled
        self.grammar_stats = grammar_stats
        # int32 ids: a long output costs 4 bytes a token here (a list: ~36)
        self.path: array = array("i") if path is None else path
        self.check = check
        self.valid: bool | None = None

    @property
    def finished(self) -> bool:
        """SGLang's flag: the request finished (set by its scheduler after every token)."""
        return self._finished

    @finished.setter
    def finished(self, value: bool) -> None:
        if value and not self._finished and self.check is not None and self.is_terminated():
            # SGLang's caller has the request as ``req``; its id names the request in the log
            req = sys._getframe(1).f_locals.get("req")
            self.valid = log_if_invalid(
                self.backend,
                self.check,
                self.compiled.warnings,
                self.path,
                str(getattr(req, "rid", None) or repr(self)),
            )
        self._finished = value

    def recover(self) -> None:
        """Replace a failed matcher by a fresh one that replays :attr:`path` (rare: O(len))."""
        logger.warning(
            "spec-grammar: %r: matcher failed, replaying %d tokens", self, len(self.path)
        )
        m = compose_matcher(self.backend, self.compiled)
        try:
            done = m.accept_tokens(self.path.tolist())
        except GrammarStateError:
            done = -1
        if done != len(self.path):
            raise GrammarStateError(f"{self!r}: replaying the accepted tokens failed")
        self.matcher = m

    # -- token-level state -------------------------------------------------------------------
    def accept_token(self, token: int) -> None:
        """Advance by ``token``. Raises ``ValueError`` (SGLang then aborts this request only)
        when the grammar refuses it, when it is outside ``[0, V)``, once terminated, or when
        the grammar library fails at this state."""
        try:
            if self.matcher.is_terminated():
                raise ValueError(f"token {int(token)} after the grammar terminated")
            ok = self.matcher.accept_token(token)  # InvalidTokenError is a ValueError
        except GrammarStateError as e:
            self.recover()
            raise ValueError(f"token {int(token)}: the grammar library failed: {e}") from e
        if not ok:
            raise ValueError(f"token {int(token)} is not allowed by the grammar here")
        self.path.append(int(token))
        self.current_token = int(token)

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens, termination included (O(k)). Raises
        :class:`~spec_grammar.errors.GrammarStateError` beyond ``max_rollback_tokens`` or
        the tokens accepted so far."""
        m = self.matcher
        k = operator.index(k)
        if not 0 <= k <= min(len(self.path), m.max_rollback_tokens):
            raise GrammarStateError(
                f"rollback({k}) with {len(self.path)} tokens accepted "
                f"(max_rollback_tokens={m.max_rollback_tokens})"
            )
        try:
            m.rollback(k)
        except GrammarStateError:
            del self.path[len(self.path) - k :]
            self.recover()
            return
        del self.path[len(self.path) - k :]

    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""
        try:
            return self.matcher.is_terminated()
        except GrammarStateError:
            self.recover()
            return self.matcher.is_terminated()

    def copy(self) -> SGLangGrammar:
        """An independent copy. SGLang copies its cached grammar, at the start state, for
        every request: that copy is a new matcher (:meth:`GrammarBackend.matcher`, a few µs)
        rather than a :meth:`SpecGrammar.fork`, whose library matcher stays shared with the
        cached grammar, so every request of one schema would move that one library matcher
        to its own output at each use (rolling back and replaying up to
        ``max_rollback_tokens`` tokens per request per step). A copy of an advanced object is
        a fork."""
        stats = self.grammar_stats
        if stats is not None:
            stats = dataclasses.replace(stats, is_cache_hit=True, tree_traversal_time=[])
        m = self.matcher
        if not self.path:
            twin = compose_matcher(self.backend, self.compiled)
        else:
            twin = m.fork()
        return SGLangGrammar(
            self.backend, twin, self.compiled, stats, array("i", self.path), self.check
        )

    # -- masks ---------------------------------------------------------------------------------
    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        """A ``(batch_size, ceil(vocab_size / 32))`` int32 mask on ``device``, all -1 (every
        token allowed); pinned on the host when CUDA is present, so the later upload can be
        non-blocking."""
        return allocate_mask(vocab_size, batch_size, device).fill_(-1)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write the allowed set of the current state into row ``idx`` of the CPU mask.
        Raises :class:`~spec_grammar.errors.BitmaskError` on a mask of another width. A state
        at which the grammar library fails (twice: once more after :meth:`recover`) gets an
        all-zero row. Raises :class:`~spec_grammar.errors.GrammarStateError` once terminated
        (SGLang fills only live grammars)."""
        if self.is_terminated():
            self.matcher.fill_next_token_bitmask(vocab_mask, idx)  # raises, with the reason
        for _ in range(2):
            try:
                self.matcher.fill_next_token_bitmask(vocab_mask, idx)
                return
            except GrammarStateError:
                self.recover()
        vocab_mask[idx] = 0

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        """Back to all-allowed."""
        vocab_mask.fill_(-1)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        """The mask on ``device`` (non-blocking from pinned memory)."""
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        """Disallowed logits to ``-inf`` in place: ``logits (rows, V)`` fp32/fp16/bf16,
        ``vocab_mask (rows, W)`` int32 on the same device; spec-grammar's kernels (Triton on
        CUDA, the torch path elsewhere)."""
        apply_token_bitmask_inplace(logits, vocab_mask)

    def __repr__(self) -> str:
        return f"SGLangGrammar({self.compiled.spec.kind}, backend={self.compiled.backend_name})"


class SGLangGrammarBackend(BaseGrammarBackend):
    """SGLang's grammar backend over a spec-grammar :class:`GrammarBackend`.

    Args:
        backend: the spec-grammar backend (bound to the served tokenizer and logits width).
        whitespace: JSON whitespace policy of ``json_schema`` requests (``"flexible"`` is
            SGLang's default, any whitespace; ``"spaced"`` with
            ``--constrained-json-disable-any-whitespace``).
        strict: compile JSON schemas in strict mode (refuse keywords the library would not
            enforce); otherwise such keywords are logged as warnings and the request's
            completed output is checked (:class:`SGLangGrammar` ``check``).

    A grammar that does not compile, or that the backend cannot represent, becomes an
    :class:`InvalidGrammarObject` carrying the reason (SGLang aborts the request with it).
    """

    def __init__(
        self, backend: GrammarBackend, *, whitespace: str = "flexible", strict: bool = False
    ):
        super().__init__()
        self.backend = backend
        self.whitespace = whitespace
        self.strict = strict

    def _build(self, spec_fn: Any, key_string: str, dispatch_type: str) -> BaseGrammarObject:
        try:
            spec: GrammarSpec = spec_fn()
            compiled = self.backend.compile(spec)
            matcher = compose_matcher(self.backend, compiled)
            # a grammar whose start state allows no token (``root ::= root``) accepts no
            # document: xgrammar hands out an empty row, llguidance's matcher fails at the
            # first fill, which would raise inside SGLang's batch mask fill
            row = allocate_mask(matcher.info.vocab_size, 1)
            try:
                matcher.fill_next_token_bitmask(row, 0)
                failed = None if bool(row.any()) else "it allows no token"
            except GrammarStateError as e:
                failed = f"its matcher failed: {e}"
            if failed:
                raise GrammarCompileError(
                    f"the grammar accepts no document (at its start state {failed})",
                    backend=self.backend.name,
                )
        # RecursionError: json.loads of a deeply nested key string
        except (SpecGrammarError, ValueError, RecursionError) as e:
            logger.error(
                "spec-grammar:%s cannot serve %s %.200r: %s",
                self.backend.name,
                dispatch_type,
                key_string,
                e,
            )
            return InvalidGrammarObject(f"{type(e).__name__}: {e}")
        for line in compiled.warnings:
            logger.warning("spec-grammar:%s does not enforce %s", self.backend.name, line)
        return SGLangGrammar(
            self.backend,
            matcher,
            compiled,
            GrammarStats(dispatch_type=dispatch_type),
            check=spec if needs_check(compiled) else None,
        )

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        """A JSON-schema request (``"$$ANY$$"``: any JSON value)."""

        def spec() -> JsonSchema:
            schema = {} if key_string == "$$ANY$$" else json.loads(key_string)
            return JsonSchema(schema, whitespace=self.whitespace, strict=self.strict)

        return self._build(spec, key_string, "json")

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        """A regex request (the whole output matches)."""
        return self._build(lambda: Regex(key_string), key_string, "regex")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        """An EBNF request, in GBNF (xgrammar's dialect, root rule ``root``)."""
        return self._build(lambda: Ebnf(key_string), key_string, "ebnf")

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        """Structural tags are xgrammar's own format: refused with the reason."""
        return InvalidGrammarObject(
            "structural_tag is not supported by the spec-grammar backends; serve it with "
            "--grammar-backend xgrammar"
        )


THREADS_ENV = "SPEC_GRAMMAR_SGLANG_THREADS"
"""Environment variable: threads of the batched draft-tree fill (the backends'
``num_threads``, for those that have one); unset: each backend's default."""


def _threads() -> int | None:
    """:data:`THREADS_ENV` as a thread count, or None when unset. Raises ``ValueError`` naming
    the variable on anything but a positive integer."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {raw!r}")
    return int(raw)


def make_backend_factory(name: str):
    """SGLang's ``init_func`` for spec-grammar backend ``name``: called by SGLang's
    ``create_grammar_backend`` as ``init(server_args, tokenizer, vocab_size, eos_token_ids)``
    in every scheduler process. ``vocab_size`` is the logits width; ``eos_token_ids`` (a set,
    or None: the tokenizer's EOS) become the stop tokens. Raises
    :class:`~spec_grammar.errors.BackendNotFoundError` when the backend's library is missing
    and ``ValueError`` on a malformed :data:`THREADS_ENV` or strict variable
    (:func:`~spec_grammar.integrations.post_check.strict_from_env`)."""

    def init(server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Any = None):
        stop = sorted(int(t) for t in eos_token_ids) if eos_token_ids else None
        threads = _threads()
        backend = get_backend(name, tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        if threads is not None and hasattr(backend, "num_threads"):
            backend.num_threads = threads
        compact = getattr(server_args, "constrained_json_disable_any_whitespace", False)
        strict = strict_from_env(STRICT_ENV)
        return SGLangGrammarBackend(
            backend, whitespace="spaced" if compact else "flexible", strict=strict
        )

    init.__name__ = init.__qualname__ = f"init_spec_grammar_{name}"
    return init
