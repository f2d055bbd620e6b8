"""What :meth:`GrammarBackend.compile <spec_grammar.protocol.GrammarBackend.compile>` does around
an adapter's ``_compile``: :func:`compile_spec` (checks, strict mode, timeout, error wrapping),
:class:`CompileCache` (results and errors, in-flight deduplication) and the result,
:class:`CompiledGrammar`."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .compile_worker import RemoteLibraryError
from .errors import GrammarCompileError, SpecGrammarError, UnsupportedGrammarError
from .json_schema.check import check_json_schema, has_finite_document
from .json_schema.limits import LIMIT_FIELDS, cap_lengths, close_objects, limit_applies
from .json_schema.strict import KeywordSupport, unenforced_keywords
from .nesting import check_nesting, recursion_room, too_deep
from .specs import GrammarSpec, JsonSchema, ToolCalls

if TYPE_CHECKING:
    from .protocol import GrammarBackend

__all__ = [
    "CompiledGrammar",
    "CompileCache",
    "compile_spec",
    "checked_cache_key",
    "checked_schema",
    "LibraryResult",
]


@dataclass(frozen=True)
class LibraryResult:
    """What an adapter's ``_compile`` may return instead of the bare native object when the
    compile enforces less than the spec asks: ``warnings`` are lines in the form of
    :func:`~spec_grammar.json_schema.strict.unenforced_keywords` (``"<keyword> at <pointer>:
    <why>"``), from the library's own warnings or log lines and from the adapter's rewrites
    (a ``pattern`` left out, ...). :func:`compile_spec` appends them to
    :attr:`CompiledGrammar.warnings`; in strict mode it raises :class:`UnsupportedGrammarError`
    instead."""

    native: Any
    warnings: tuple[str, ...] = ()


@dataclass(eq=False)
class CompiledGrammar:
    """A compiled grammar: the backend's own object plus where it came from.

    Attributes:
        spec: the spec it was compiled from.
        backend_name: name of the backend that compiled it (matchers check it).
        native: the library's compiled object (opaque to callers).
        compile_time_s: wall time of the compile in seconds (0 for a cache hit's original).
        backend_id: ``id()`` of the backend instance that compiled it (its matchers only).
        warnings: one line per JSON-Schema keyword the backend compiled but does not enforce
            (see :mod:`spec_grammar.json_schema.strict`); empty when the grammar is enforced in
            full.
        route: with the ``auto`` backend (:mod:`spec_grammar.routing`), ``"<backend>:
            <why>"``; None otherwise.
        compile_wait_s: seconds of ``compile_time_s`` spent waiting for a compile process
            (``isolation="process"``: 0 when a warm one was idle, at most a process start).
    """

    spec: GrammarSpec
    backend_name: str
    native: Any
    compile_time_s: float
    backend_id: int = 0
    warnings: tuple[str, ...] = ()
    route: str | None = None
    compile_wait_s: float = 0.0


class CompileCache:
    """LRU cache of compile results (grammars and errors) with in-flight deduplication: the
    first thread compiles, concurrent callers of the same key wait for its result.

    Args:
        max_entries: results kept (0 = none); the least recently used is evicted first.

    Attributes:
        compiles: compiles actually run (cache misses that finished, errors included).
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._done: OrderedDict[str, CompiledGrammar | SpecGrammarError] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self.compiles = 0

    def get_or_compile(
        self, key: str, compile_fn: Callable[[], CompiledGrammar]
    ) -> CompiledGrammar:
        """The cached result for ``key``, else ``compile_fn()`` run once (waiters share it).

        A cached :class:`SpecGrammarError` is raised again; any other exception of
        ``compile_fn`` propagates to every waiter and is not cached.
        """
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


def compile_spec(backend: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
    """``backend.compile(spec)``: see :meth:`GrammarBackend.compile
    <spec_grammar.protocol.GrammarBackend.compile>` for the contract.

    In order: refuse non-specs (``TypeError``), kinds the capabilities do not claim
    (:class:`UnsupportedGrammarError`), specs over ``max_nesting_depth``
    (:class:`~spec_grammar.errors.GrammarLimitError`) and over ``max_grammar_bytes``
    (:class:`GrammarCompileError`); then, once per cache key: ``ToolCalls`` -> its
    :class:`JsonSchema`, the meta-schema check, strict mode (refuse unenforced keywords) or
    warnings, the output limits' schema rewrites (:func:`~spec_grammar.json_schema.limits.cap_lengths`,
    :func:`~spec_grammar.json_schema.limits.close_objects`;
    what the backend does not enforce of them, or of the limits it enforces itself, is a
    warning even in strict mode: strict is about the user's schema), ``backend._compile``
    under ``compile_timeout_s`` (a :class:`LibraryResult` adds the adapter's warnings, or
    raises in strict mode). Errors are cached too; library exceptions become
    :class:`GrammarCompileError` with the library's reason, a ``RecursionError`` of a spec
    within ``max_nesting_depth`` a :class:`~spec_grammar.errors.GrammarLimitError`.
    """
    if not isinstance(spec, GrammarSpec):
        raise TypeError(
            f"compile() takes a grammar spec (JsonSchema, Regex, ...), got {type(spec).__name__}"
        )
    if not getattr(backend.capabilities, spec.kind, False):
        raise UnsupportedGrammarError(
            f"{spec.kind} grammars are not supported", backend=backend.name
        )
    if isinstance(spec, ToolCalls) and not backend.capabilities.json_schema:
        # tool calls compile through json_schema; tool_calls defaults to True, so an adapter
        # declaring json_schema=False alone would get a JsonSchema it never claimed
        raise UnsupportedGrammarError(
            "tool_calls grammars are not supported: they compile as JSON schemas, which this "
            "backend does not support",
            backend=backend.name,
        )

    key = checked_cache_key(backend, spec)
    if len(key) > backend.max_grammar_bytes:
        raise GrammarCompileError(
            f"the {spec.kind} spec is {len(key)} bytes, over max_grammar_bytes={backend.max_grammar_bytes}",
            backend=backend.name,
        )

    def run() -> CompiledGrammar:
        t0 = time.perf_counter()
        target = spec.to_json_schema() if isinstance(spec, ToolCalls) else spec
        ignored: list[str] = []
        waited = 0.0
        try:
            if isinstance(target, JsonSchema):
                ignored = checked_schema(target, backend.json_schema_support)
                target, limit_notes = _with_limits(backend, target, ignored)
                ignored = ignored + limit_notes
            native, waited = _compile_with_timeout(backend, target)
            if isinstance(native, LibraryResult):
                extra = [w for w in native.warnings if w not in ignored]
                native = native.native
                strict = getattr(target, "strict", False) is True  # JsonSchema, Ebnf, Lark
                if strict:
                    extra_strict = [
                        w for w in extra if w.split(" ", 1)[0].split(":")[0] not in LIMIT_FIELDS
                    ]
                else:
                    extra_strict = []
                if extra_strict:
                    raise UnsupportedGrammarError(
                        f"strict mode: {len(extra_strict)} keyword use(s) would not be enforced: "
                        + "; ".join(extra_strict[:5])
                        + ("; ..." if len(extra_strict) > 5 else "")
                    )
                ignored = ignored + extra
        except SpecGrammarError as e:
            if isinstance(e, GrammarCompileError) and e.backend is None:
                raise type(e)(str(e), backend=backend.name, reason=e.reason) from e
            raise
        except RecursionError as e:  # a recursive check, rewrite or parser met the nesting
            raise too_deep(
                spec, "a recursive step of the compile", backend.max_nesting_depth, backend.name
            ) from e
        except Exception as e:  # library errors: RuntimeError, ValueError, ...
            remote = isinstance(e, RemoteLibraryError)  # raised in a compile process
            reason = e.reason if remote else backend._library_error_reason(e)
            raise GrammarCompileError(
                f"{spec.kind} failed to compile: {e.type_name if remote else type(e).__name__}: {reason}",
                backend=backend.name,
                reason=reason,
            ) from e
        return CompiledGrammar(
            spec,
            backend.name,
            native,
            time.perf_counter() - t0,
            id(backend),
            tuple(ignored),
            compile_wait_s=waited,
        )

    return backend._cache.get_or_compile(key, run)


def checked_schema(spec: JsonSchema, support: KeywordSupport) -> list[str]:
    """The checks of a JSON-schema compile that need no library: raises
    :class:`GrammarCompileError` for an invalid schema (the meta-schema) or one accepting no
    finite document, :class:`UnsupportedGrammarError` for a strict ``spec`` of which
    ``support`` (a backend's ``json_schema_support``) leaves keywords unenforced; otherwise
    returns those keywords' lines (:func:`~spec_grammar.json_schema.strict.unenforced_keywords`).
    Errors carry no backend name (the caller adds it). Imports no torch (the CLI's
    :mod:`~spec_grammar.precheck` runs it before the libraries load)."""
    check_json_schema(spec.json_schema)
    if spec.json_schema is False:
        raise GrammarCompileError("the schema `false` accepts no document")
    if not has_finite_document(spec.json_schema):
        raise GrammarCompileError(
            "the schema accepts no finite document (a required property or item "
            "refers back to its own schema, or meets `false` / `enum: []`)"
        )
    ignored = unenforced_keywords(spec.json_schema, support)
    if ignored and spec.strict:
        raise UnsupportedGrammarError(
            f"strict mode: {len(ignored)} keyword use(s) would not be enforced: "
            + "; ".join(ignored[:5])
            + ("; ..." if len(ignored) > 5 else "")
        )
    return ignored


def checked_cache_key(backend: GrammarBackend, spec: GrammarSpec) -> str:
    """``spec.cache_key()`` once ``spec`` is within ``backend.max_nesting_depth``
    (:func:`~spec_grammar.nesting.check_nesting`, before any library call); raises
    :class:`~spec_grammar.errors.GrammarLimitError` for a spec over it, or one within it that
    the serializer cannot write (pydantic stops near depth 255, ``json`` at Python's recursion
    limit)."""
    check_nesting(spec, backend.max_nesting_depth, backend.name, backend.native_max_nesting_depth)
    recursion_room(backend.max_nesting_depth)
    try:
        return spec.cache_key()
    except (RecursionError, ValueError) as e:
        raise too_deep(
            spec, "the serializer of the cache key", backend.max_nesting_depth, backend.name
        ) from e


def _with_limits(
    backend: GrammarBackend, spec: JsonSchema, ignored: list[str]
) -> tuple[JsonSchema, list[str]]:
    """``spec`` with its output limits' caps written into the schema
    (:func:`~spec_grammar.json_schema.limits.cap_lengths`), and the warnings the limits add:
    keyword uses of the rewritten schema the backend does not enforce that the user's schema
    did not have already (``ignored``), and a line per limit set that the backend does not
    enforce itself or leaves out of its schemas (:attr:`GrammarBackend.schema_caps`;
    ``max_whitespace`` counts only under ``whitespace="flexible"``, the one policy that writes
    runs)."""
    limits = spec.limits
    if limits is None or limits.is_empty():
        return spec, []
    notes: list[str] = []
    skipped = {
        k: None if k != "closed_objects" else False
        for k in ("max_string_length", "max_items", "closed_objects")
        if k not in backend.schema_caps and getattr(limits, k) not in (None, False)
    }
    capped = cap_lengths(spec.json_schema, limits.model_copy(update=skipped))
    if limits.closed_objects and "closed_objects" in backend.schema_caps:
        capped = close_objects(capped)
    if capped is not spec.json_schema:
        spec = JsonSchema(capped, whitespace=spec.whitespace, strict=spec.strict, limits=limits)
        notes = [
            w for w in unenforced_keywords(capped, backend.json_schema_support) if w not in ignored
        ]
    for name in ("max_digits", "max_whitespace", *skipped):
        if getattr(limits, name) in (None, False):
            continue
        if name in backend.output_limits and name not in skipped:
            continue
        if name == "max_whitespace" and spec.whitespace != "flexible":
            continue
        if not limit_applies(spec.json_schema, name, limits):  # nothing there it would bound
            continue
        notes.append(f"{name} at /: the {backend.name} backend does not enforce this output limit")
    return spec, notes


def _compile_with_timeout(backend: GrammarBackend, spec: GrammarSpec) -> tuple[Any, float]:
    """``backend._compile(spec)`` under ``compile_timeout_s``. With a compile pool
    (``isolation="process"``) in a child process, killed past the limit
    (:meth:`CompilePool.run <spec_grammar.compile_worker.CompilePool.run>`), its result
    rebuilt by ``backend._import_native``. Otherwise in a daemon thread when the limit is set:
    the library call cannot be interrupted, so past the limit it is abandoned (its result
    dropped) and :class:`GrammarCompileError` is raised. Returns ``(native, seconds waited
    for a compile process)``."""
    pool = backend.compile_pool
    if pool is not None:
        payload, warnings, waited = pool.run(spec, backend.compile_timeout_s)
        native = backend._import_native(payload)
        return (native if warnings is None else LibraryResult(native, warnings)), waited
    if backend.compile_timeout_s is None:
        return backend._compile(spec), 0.0
    box: Future = Future()

    def target() -> None:
        try:
            box.set_result(backend._compile(spec))
        except BaseException as e:
            box.set_exception(e)

    threading.Thread(target=target, name=f"{backend.name}-compile", daemon=True).start()
    try:
        return box.result(timeout=backend.compile_timeout_s), 0.0
    except TimeoutError:
        raise GrammarCompileError(
            f"{spec.kind} compile did not finish within compile_timeout_s={backend.compile_timeout_s}"
        ) from None
