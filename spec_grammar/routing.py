"""Per-request backend routing: the ``auto`` backend.

The built-in libraries differ in what they enforce (each adapter declares it:
:attr:`~spec_grammar.protocol.GrammarBackend.json_schema_support`,
:attr:`~spec_grammar.protocol.GrammarBackend.output_limits`,
:attr:`~spec_grammar.protocol.GrammarBackend.schema_caps`, the
:class:`~spec_grammar.capabilities.Capabilities`), and which one enforces a given spec is
knowable before compiling. :func:`rank` orders the registered backends for one spec by:

1. the grammar kind: a backend whose capabilities do not claim it is out;
2. what it would leave unenforced of the user's spec
   (:func:`~spec_grammar.json_schema.strict.unenforced_keywords` on the schema as written, the
   tool list's call schema for :class:`~spec_grammar.specs.ToolCalls`), fewest first;
3. the output limits the spec sets that the backend does not enforce (ours, not the user's:
   they weigh after every keyword of the user's);
4. the measured cost, :data:`MEASURED_COST` (compile ms + mask us per token x
   :data:`TOKENS_PER_REQUEST`), cheapest first; a backend without a measurement (a third-party
   adapter) after every measured one, by name.

:class:`AutoBackend` (registered as ``auto``, so every door takes it: ``get_backend("auto",
tokenizer)``, ``--grammar-backend auto``, SGLang's ``spec-grammar:auto``, the vLLM plugin's
backend variable) compiles each spec on the first backend of its ranking that compiles it, and
says which and why in :attr:`CompiledGrammar.route <spec_grammar.compile.CompiledGrammar.route>`.
Third-party adapters of the entry-point group ``spec_grammar.backends`` take part through
their declarations. How :data:`MEASURED_COST` was measured: ``docs/routing.md``
(``benchmarks/bench_routing.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from .capabilities import Capabilities
from .compile import CompiledGrammar, checked_cache_key
from .errors import SpecGrammarError, UnsupportedGrammarError
from .nesting import too_deep
from .protocol import GrammarBackend, SpecGrammar
from .ranking import (
    AUTO,
    MEASURED_COST,
    TOKENS_PER_REQUEST,
    Route,
    backends_taking,
    rank,
    registered_classes,
    same_everywhere,
    unenforced_limits,
    user_unenforced,
)
from .specs import GrammarSpec
from .tree import DraftTree

__all__ = [
    "AutoBackend",
    "Route",
    "rank",
    "user_unenforced",
    "unenforced_limits",
    "backends_taking",
    "MEASURED_COST",
    "TOKENS_PER_REQUEST",
]


class AutoBackend(GrammarBackend):
    """The ``auto`` backend: per spec, the registered backend :func:`rank` puts first that
    compiles it (a library refusal moves on to the next; the error of the first is raised when
    none does). Each chosen backend is made once, for the same tokenizer and options; options
    a backend does not take leave it out of the routing (said in :attr:`excluded`).

    :meth:`compile` returns the chosen backend's :class:`CompiledGrammar` with ``route`` set
    (``"<name>: <reason>"``); :meth:`matcher` and :meth:`fill_tree_bitmasks` go to the backend
    that compiled it. Raises what :class:`GrammarBackend` raises for bad options."""

    name = AUTO
    capabilities = Capabilities(json_schema=True, regex=True, ebnf=True, lark=True, tool_calls=True)

    def __init__(self, tokenizer: Any, **options: Any):
        base = {
            k: options[k]
            for k in (
                "vocab_size",
                "stop_token_ids",
                "max_rollback_tokens",
                "compile_cache_size",
                "compile_timeout_s",
                "max_grammar_bytes",
                "max_forced_tokens",
                "max_nesting_depth",
            )
            if k in options
        }
        # its own compile only routes: the chosen backend's isolation (an option passed on)
        # bounds the library call
        super().__init__(tokenizer, **base, isolation="thread")
        self._tokenizer = tokenizer
        self._options = options
        self._lock = threading.Lock()
        self._children: dict[str, GrammarBackend] = {}
        self._by_id: dict[int, GrammarBackend] = {}
        self._owner: weakref.WeakKeyDictionary[SpecGrammar, GrammarBackend] = (
            weakref.WeakKeyDictionary()
        )
        self._threads: int | None = None
        self.excluded: dict[str, str] = {}
        """backend name -> why it takes no part (its library missing, an option refused)."""
        self._classes: dict[str, type[GrammarBackend]] = {}
        for name, cls in registered_classes().items():
            if isinstance(cls, type):
                self._classes[name] = cls
            else:
                self.excluded[name] = str(cls)

    @classmethod
    def library_version(cls) -> str:
        return "routing"

    @property
    def num_threads(self) -> int | None:
        """Tree-fill threads given to every backend that has them (SGLang's plugin sets it:
        ``SPEC_GRAMMAR_SGLANG_THREADS``); None until set, each backend's default then."""
        return self._threads

    @num_threads.setter
    def num_threads(self, value: int) -> None:
        self._threads = value
        for b in self._children.values():
            if hasattr(b, "num_threads"):
                b.num_threads = value

    def child(self, name: str) -> GrammarBackend:
        """The backend ``name``, made on first use for this tokenizer and options."""
        with self._lock:
            b = self._children.get(name)
            if b is None:
                b = self._classes[name](self._tokenizer, **self._options)
                if self._threads is not None and hasattr(b, "num_threads"):
                    b.num_threads = self._threads
                self._children[name] = b
                self._by_id[id(b)] = b
            return b

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled on the backend :func:`rank` chooses (class docstring). Raises
        ``TypeError`` for a non-spec, :class:`UnsupportedGrammarError` when no registered
        backend claims the kind, else the first candidate's error when every one fails."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(
                f"compile() takes a grammar spec (JsonSchema, Regex, ...), got {type(spec).__name__}"
            )
        # cached as a backend's compiles are (one result per spec, errors too): a precompile
        # before the model loads is the worker's own compile, not a second routing
        key = checked_cache_key(self, spec)
        return self._cache.get_or_compile(key, lambda: self._route(spec))

    def _route(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            routes = rank(spec, self._classes)
            if routes:
                same_everywhere(spec, routes[0])
        except RecursionError as e:  # the keyword walks of the ranking met the nesting
            raise too_deep(
                spec, "the routing's keyword check", self.max_nesting_depth, self.name
            ) from e
        if not routes:
            raise UnsupportedGrammarError(
                f"{spec.kind} grammars are not supported by any registered backend "
                f"({', '.join(self._classes) or 'none'})",
                backend=self.name,
            )
        first: SpecGrammarError | None = None
        for route in routes:
            try:
                child = self.child(route.name)
            except (TypeError, ValueError) as e:  # an option this backend does not take
                self.excluded.setdefault(route.name, f"{type(e).__name__}: {e}")
                continue
            try:
                compiled = child.compile(spec)
            except SpecGrammarError as e:
                first = first or e
                continue
            why = route.reason(routes)
            if first is not None:
                why += f"; {first.backend or 'a backend'} failed first: {str(first)[:120]}"
            return replace(compiled, route=f"{route.name}: {why}")
        if first is None:
            raise UnsupportedGrammarError(
                f"no backend could be made: {self.excluded}", backend=self.name
            )
        raise first

    def _backend_of(self, compiled: CompiledGrammar) -> GrammarBackend:
        b = self._by_id.get(compiled.backend_id)
        if b is None:
            from .errors import GrammarStateError

            raise GrammarStateError(
                "this CompiledGrammar was not compiled by this backend instance"
            )
        return b

    def matcher(self, compiled: CompiledGrammar) -> SpecGrammar:
        """A fresh matcher of the backend that compiled ``compiled``."""
        b = self._backend_of(compiled)
        m = b.matcher(compiled)
        self._owner[m] = b
        return m

    def fill_tree_bitmasks(
        self,
        jobs: Sequence[tuple[SpecGrammar, DraftTree, int]],
        bitmask: torch.Tensor,
        *,
        zero_dead_rows: bool = True,
    ) -> list[torch.Tensor]:
        """Each backend fills its own requests' rows (its parallel path); other matchers (forks,
        wrappers) go through the owner of nothing: the generic per-job fill."""
        groups: dict[int, list[int]] = {}
        for i, (m, _, _) in enumerate(jobs):
            owner = self._owner.get(m)
            groups.setdefault(id(owner) if owner is not None else 0, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(jobs)
        for key, idx in groups.items():
            sub = [jobs[i] for i in idx]
            owner = self._by_id.get(key)
            if owner is None:
                res = super().fill_tree_bitmasks(sub, bitmask, zero_dead_rows=zero_dead_rows)
            else:
                res = owner.fill_tree_bitmasks(sub, bitmask, zero_dead_rows=zero_dead_rows)
            for i, r in zip(idx, res):
                out[i] = r
        return out  # type: ignore[return-value]

    def _compile(self, spec: GrammarSpec) -> Any:  # compile() routes; never reached
        raise NotImplementedError

    def _matcher(self, compiled: CompiledGrammar) -> SpecGrammar:  # matcher() routes
        raise NotImplementedError
