"""Compiles that can be killed: :class:`CompilePool`, warm child processes that run a backend's
``_compile`` under a memory cap (``RLIMIT_AS``) and a wall-clock limit that holds.

A library call cannot be interrupted from Python: in a thread, a compile past
``compile_timeout_s`` keeps running and holding the interpreter (a later compile then waited
behind it), and a native allocation failure aborts the whole process (SIGABRT). In a child
process the compile is killed (SIGKILL) at its time limit, its death is a typed error, and
the parent lives on. What runs where (:func:`compile_spec <spec_grammar.compile.compile_spec>`):
the spec checks, strict mode, the limits' rewrites and the cache stay in the parent; only
``backend._compile(spec)`` runs in the child, whose result comes back through the backend's
``_export_native`` / ``_import_native`` hooks (outlines-core's ``Index`` pickles, xgrammar's
``CompiledGrammar`` has ``serialize_json``).

Each child is started once (a fresh interpreter, ``python -c``: nothing inherited from a parent
holding torch's or an engine's threads, and no main script run again), builds its own copy of
the backend from the parent's constructor arguments (the tokenizer shipped once, as its
:class:`~spec_grammar.tokenizer_info.TokenizerInfo`) and serves compiles one at a time until
it is killed or its parent exits. The pool keeps one idle child spare beyond those busy, so a
compile after a killed one takes the spare instead of waiting for a new interpreter; a compile
finding no idle child (several at once, or right after a kill when the spare is still
starting) waits for one to start (:data:`CHILD_START_BOUND_S`).
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .errors import GrammarCompileError, GrammarLimitError, SpecGrammarError
from .nesting import recursion_room

if TYPE_CHECKING:
    from .protocol import GrammarBackend
    from .specs import GrammarSpec

__all__ = [
    "CompilePool",
    "ISOLATIONS",
    "ISOLATION_ENV",
    "DEFAULT_COMPILE_MEMORY_BYTES",
    "CHILD_START_BOUND_S",
    "RemoteLibraryError",
    "resolve_isolation",
    "check_memory_bytes",
]

ISOLATIONS = ("process", "thread")
"""Values of a backend's ``isolation``: ``"process"`` runs ``_compile`` in a :class:`CompilePool`
child, ``"thread"`` in a daemon thread of the calling process (abandoned past its limit)."""

ISOLATION_ENV = "SPEC_GRAMMAR_ISOLATION"
"""Environment variable that, when set (``process`` or ``thread``), replaces every backend's
default ``isolation`` (an ``isolation`` argument still wins)."""

DEFAULT_COMPILE_MEMORY_BYTES = 8 << 30
"""Default ``compile_memory_bytes``: the address space a compile child may take (8 GiB, its
interpreter, torch and the backend's vocabulary tables included: about 1-1.5 GiB of it before
the first compile)."""

CHILD_START_BOUND_S = 30.0
"""How long a compile waits for a child to start before it fails (a start measured 2-6 s on a
loaded 2-core host: a fresh interpreter imports torch and builds the backend)."""

_ENTRY = "import sys; from spec_grammar.compile_worker import _child_entry; _child_entry(int(sys.argv[1]))"

_POOLS: weakref.WeakSet[CompilePool] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    # a child in a compile reads no end of file until it is done: killed with its parent
    for pool in list(_POOLS):
        pool.close(busy=True)


class RemoteLibraryError(Exception):
    """A library exception raised by ``_compile`` in a compile child, carried back as the
    name of its type and the backend's reason for it (library exceptions need not pickle):
    :func:`~spec_grammar.compile.compile_spec` wraps it as it wraps a local one."""

    def __init__(self, type_name: str, reason: str):
        super().__init__(reason)
        self.type_name = type_name
        self.reason = reason


def resolve_isolation(cls: type, value: Any) -> str:
    """The isolation of a backend of class ``cls`` given the constructor's ``value``: ``value``
    itself, else :data:`ISOLATION_ENV`, else ``cls.compile_isolation``; the default (not an
    explicit ``"process"``) falls back to ``"thread"`` for a class a child cannot import.

    Raises ``ValueError`` for a value (or variable) outside :data:`ISOLATIONS` and for
    ``"process"`` asked for a class a child cannot import by name (defined in a function or in
    ``__main__``)."""
    explicit = value is not None
    where = "isolation"
    if value is None and os.environ.get(ISOLATION_ENV):
        value, where, explicit = os.environ[ISOLATION_ENV].strip(), ISOLATION_ENV, True
    if value is None:
        value = getattr(cls, "compile_isolation", "thread")
    if value not in ISOLATIONS:
        raise ValueError(f"{where} must be one of {', '.join(ISOLATIONS)}, got {value!r:.40}")
    if value == "process" and not _importable(cls):
        if explicit:
            raise ValueError(
                f"isolation='process' needs a backend class a compile process can import by "
                f"name; {cls.__module__}.{cls.__qualname__} is defined in a function or in "
                "__main__: move it into a module, or pass isolation='thread'"
            )
        return "thread"
    return value


def _importable(cls: type) -> bool:
    return cls.__module__ != "__main__" and "<locals>" not in cls.__qualname__


def check_memory_bytes(value: Any) -> int | None:
    """``compile_memory_bytes`` checked: None (no cap) or an int > 0, else ``ValueError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"compile_memory_bytes must be None (no cap) or a number of bytes > 0, got {value!r:.40}"
        )
    return value


def child_arguments(backend: GrammarBackend) -> tuple[type, tuple, dict[str, Any]]:
    """``(class, args, kwargs)`` that rebuild ``backend`` in a compile child: its constructor's
    arguments (recorded by ``GrammarBackend.__new__``) with the tokenizer replaced by the
    backend's :class:`TokenizerInfo` (logits width and stop ids already in it) and the child's
    own compiles unbounded and in-thread (its parent bounds them)."""
    args, kwargs = backend._init_args
    kwargs = {
        k: v
        for k, v in kwargs.items()
        if k not in ("tokenizer", "vocab_size", "stop_token_ids", "compile_memory_bytes")
    }
    kwargs.update(isolation="thread", compile_timeout_s=None)
    return type(backend), (backend.tokenizer_info, *args[1:]), kwargs


class _Child:
    """One compile process and the parent's end of its socket.

    Started as ``python -c`` running :func:`_child_entry` (not through ``multiprocessing``: its
    ``spawn`` runs the main script again in the child, which breaks a script without an
    ``if __name__ == "__main__"`` guard), with the parent's ``sys.path``, so the child
    imports the same packages, the backend's module included."""

    def __init__(self, payload: bytes, memory_bytes: int | None, name: str):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop(ISOLATION_ENV, None)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, str(theirs.fileno()), name],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        self.conn.send_bytes(pickle.dumps((payload, memory_bytes)))

    def wait_ready(self, timeout: float) -> None:
        """Block until the child built its backend; raises :class:`GrammarCompileError` when it
        could not (its reason) or did not within ``timeout`` seconds (then it is killed)."""
        ready = multiprocessing.connection.wait([self.conn], timeout)
        msg: Any = None
        if self.conn in ready:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = None
        if isinstance(msg, tuple) and msg[0] == "ready":
            return
        self.kill()
        if msg is None and not ready:
            why = f"it did not start within {timeout:.0f} s"
        elif msg is None:
            why = f"it exited while starting ({_exit_name(self.process.returncode)})"
        else:
            why = msg[1]
        raise GrammarCompileError(f"the compile process could not start: {why}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (when still running), reaped; the socket closed."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: left to init
            pass
        self.conn.close()


class CompilePool:
    """Warm child processes running ``_compile`` of one backend.

    Args:
        backend: the backend whose compiles run here; its constructor arguments are pickled
            once (:func:`child_arguments`: ``TypeError`` / ``pickle.PicklingError`` when they do
            not pickle) and each child rebuilds it from them. The pool keeps no reference to it.
        memory_bytes: ``RLIMIT_AS`` of each child (None: no cap), set after the child built
            its backend; a child whose baseline is already above it does not start.

    One child is started in the background at once; :meth:`run` takes an idle child (or
    waits for one to start), and keeps one spare idle beyond the busy ones. Thread-safe.
    """

    spare = 1
    """Idle children kept started beyond the busy ones (:meth:`warm` may raise it)."""

    def __init__(self, backend: GrammarBackend, memory_bytes: int | None):
        self.memory_bytes = memory_bytes
        self._name = backend.name
        self._payload = pickle.dumps(child_arguments(backend))
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._starting = 0
        self._waiting = 0
        self._failure: GrammarCompileError | None = None
        self._closed = False
        self._busy: set[_Child] = set()
        self.children_started = 0
        """Children started so far (the first, spares, replacements of killed ones)."""
        with self._cond:
            self._top_up()
        _POOLS.add(self)

    # -- children -----------------------------------------------------------------------------
    def _top_up(self) -> None:
        """Start children in the background until the idle and starting ones cover the waiting
        compiles plus :attr:`spare` (call with the lock held)."""
        if self._closed or self._failure is not None:
            return
        while len(self._idle) + self._starting < self._waiting + self.spare:
            self._starting += 1
            threading.Thread(
                target=self._start_one, name="spec-grammar-compile-start", daemon=True
            ).start()

    def _start_one(self) -> None:
        child = None
        try:
            child = _Child(self._payload, self.memory_bytes, self._name)
            child.wait_ready(CHILD_START_BOUND_S)
        except GrammarCompileError as e:
            child = None
            with self._cond:
                self._failure = e
        except BaseException as e:  # noqa: BLE001  (a start that cannot run is every compile's error)
            if child is not None:
                child.kill()
            child = None
            with self._cond:
                self._failure = GrammarCompileError(
                    f"the compile process could not start: {type(e).__name__}: {e}"
                )
        with self._cond:
            self._starting -= 1
            if child is not None:
                self.children_started += 1
                if self._closed:
                    child.kill()
                else:
                    self._idle.append(child)
            self._cond.notify_all()

    def _acquire(self) -> _Child:
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    if self._closed:
                        raise GrammarCompileError("the backend's compile pool is closed")
                    while self._idle:
                        child = self._idle.pop()
                        if child.alive():
                            self._busy.add(child)
                            return child
                        child.kill()
                    if self._failure is not None:
                        raise self._failure
                    self._top_up()
                    if not self._cond.wait(CHILD_START_BOUND_S * 2):
                        raise GrammarCompileError(
                            f"no compile process started within {CHILD_START_BOUND_S * 2:.0f} s"
                        )
            finally:
                self._waiting -= 1
                self._top_up()

    def _release(self, taken: _Child, child: _Child | None) -> None:
        """Put ``taken`` back (``child`` is None when it was killed)."""
        with self._cond:
            self._busy.discard(taken)
            if child is not None:
                if self._closed or len(self._idle) >= self.spare + 1 or not child.alive():
                    child.kill()
                else:
                    self._idle.append(child)
            self._top_up()
            self._cond.notify_all()

    # -- compiles ---------------------------------------------------------------------------
    def run(
        self, spec: GrammarSpec, timeout_s: float | None
    ) -> tuple[Any, tuple[str, ...] | None, float]:
        """``backend._compile(spec)`` in a child: ``(exported native, warnings or None, seconds
        waited for an idle child)``; ``timeout_s`` counts from when the child has the spec.

        Raises what ``_compile`` raised (a :class:`SpecGrammarError` as it was, a library
        exception as :class:`RemoteLibraryError`); :class:`GrammarCompileError` past
        ``timeout_s`` (the child is killed and replaced); :class:`GrammarLimitError` when the
        child ran out of memory (MemoryError, SIGABRT of a native allocation failure, SIGKILL
        of the kernel's out-of-memory killer); :class:`GrammarCompileError` for another
        death (a crash) or a child that could not start."""
        t0 = time.perf_counter()
        for attempt in range(2):
            taken = self._acquire()
            try:
                taken.conn.send(spec)
                break
            except OSError:  # it died idle (the OOM killer): another one takes the spec
                self._release(taken, None)
                taken.kill()
                if attempt:
                    raise GrammarCompileError(
                        "the compile processes die before they take a compile"
                    ) from None
        waited = time.perf_counter() - t0
        child: _Child | None = taken
        try:
            # a dead child closes its end of the socket: readable, then EOF
            ready = multiprocessing.connection.wait([child.conn], timeout_s)
            if not ready:
                child.kill()
                child = None
                raise GrammarCompileError(
                    f"{spec.kind} compile did not finish within compile_timeout_s={timeout_s}: "
                    "its compile process was killed"
                )
            try:
                msg = child.conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None:
                child.kill()
                code, child = child.process.returncode, None
                raise self._death_error(spec, code)
            kind = msg[0]
            if kind == "ok":
                return msg[1], msg[2], waited
            if kind == "memory":
                child.kill()
                child = None
                raise GrammarLimitError(
                    f"{spec.kind}: the compile ran out of memory ({msg[1]}) under "
                    f"compile_memory_bytes={self._cap()}: raise compile_memory_bytes (None = no "
                    "cap) or simplify the grammar",
                    reason=msg[1],
                )
            if kind == "compile_error":
                cls, message, reason = msg[1], msg[2], msg[3]
                raise cls(message, reason=reason)
            if kind == "error":
                raise msg[1]
            raise RemoteLibraryError(msg[1], msg[2])
        finally:
            self._release(taken, child)

    def warm(self, timeout: float = CHILD_START_BOUND_S, count: int = 1) -> bool:
        """Block until ``count`` children are idle (started and free), starting more if needed,
        or ``timeout`` seconds passed; returns whether they are. For callers (benchmarks,
        tests, a server's start) that want the next compiles not to wait for a start."""
        with self._cond:
            self.spare = max(self.spare, count)
            self._top_up()
            return (
                self._cond.wait_for(
                    lambda: len(self._idle) >= count or self._failure is not None or self._closed,
                    timeout,
                )
                and len(self._idle) >= count
            )

    def _cap(self) -> str:
        return "None" if self.memory_bytes is None else f"{self.memory_bytes / 2**30:.3g} GiB"

    def _death_error(self, spec: GrammarSpec, code: int | None) -> GrammarCompileError:
        """The error of a child that died in a compile, by its exit code."""
        name = _exit_name(code)
        if code == -signal.SIGABRT:
            return GrammarLimitError(
                f"{spec.kind}: the compile process aborted ({name}), as a library does on a "
                f"failed native allocation, under compile_memory_bytes={self._cap()}: the "
                "grammar needs more memory than that; raise compile_memory_bytes (None = no "
                "cap) or simplify the grammar (smaller repetition counts and length bounds)",
                reason=f"compile process {name}",
            )
        if code == -signal.SIGKILL:
            return GrammarLimitError(
                f"{spec.kind}: the compile process was killed ({name}), most often by the "
                "kernel's out-of-memory killer: the grammar needs more memory than the host "
                "gives; lower compile_memory_bytes to fail it sooner, or simplify the grammar",
                reason=f"compile process {name}",
            )
        return GrammarCompileError(
            f"{spec.kind}: the compile process died ({name}): the library crashed on this grammar",
            reason=f"compile process {name}",
        )

    def close(self, busy: bool = False) -> None:
        """Kill every idle child, and the busy ones too with ``busy`` (at exit); otherwise a
        busy child is killed when its compile returns."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
            running = list(self._busy) if busy else []
        for child in idle + running:
            child.kill()


def _exit_name(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _child_entry(fd: int) -> None:
    """Main of a compile process: its socket is ``fd``; the first message holds the pickled
    ``(class, args, kwargs)`` and the memory cap (:func:`_child_main`)."""
    conn = multiprocessing.connection.Connection(fd)
    try:
        payload, memory_bytes = pickle.loads(conn.recv_bytes())
        _child_main(conn, payload, memory_bytes)
    except (EOFError, OSError):  # the parent is gone (exited, or closed the pool)
        pass


def _child_main(conn: Any, payload: bytes, memory_bytes: int | None) -> None:
    """A compile child: build the backend, cap the address space, then answer compiles (one
    message per spec: ``("ok", exported, warnings)``, ``("compile_error", class, message,
    reason)``, ``("error", SpecGrammarError)``, ``("library", type name, reason)`` or
    ``("memory", what)``, after which it exits) until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from .compile import LibraryResult

    try:
        cls, args, kwargs = pickle.loads(payload)
        backend = cls(*args, **kwargs)
        recursion_room(backend.max_nesting_depth)  # the parent's room: the same specs come
        if memory_bytes is not None:
            base = _address_space_bytes()
            if base >= memory_bytes:
                raise GrammarLimitError(
                    f"compile_memory_bytes={memory_bytes / 2**30:.3g} GiB is below the compile "
                    f"process's own address space ({base / 2**30:.3g} GiB before any compile): "
                    "raise it"
                )
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            # a cap the process already has (ulimit -v, a container) is the tighter one: the
            # soft limit cannot be raised past it
            if hard != resource.RLIM_INFINITY:
                memory_bytes = min(memory_bytes, hard)
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
    except BaseException as e:  # noqa: BLE001  (told to the parent, which raises it per compile)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        fatal, native = False, None
        try:
            native = backend._compile(spec)
            warnings = None
            if isinstance(native, LibraryResult):
                native, warnings = native.native, native.warnings
            msg: tuple = ("ok", backend._export_native(native), warnings)
            data = pickle.dumps(msg)
        except MemoryError as e:
            fatal = True
            data = pickle.dumps(("memory", f"MemoryError: {e}" if str(e) else "MemoryError"))
        except GrammarCompileError as e:
            data = pickle.dumps(("compile_error", type(e), e.args[0], e.reason))
        except SpecGrammarError as e:
            data = pickle.dumps(("error", e))
        except Exception as e:  # noqa: BLE001  (a library exception: wrapped by the parent)
            data = pickle.dumps(("library", type(e).__name__, backend._library_error_reason(e)))
        del native  # a large result is freed before the next compile waits
        conn.send_bytes(data)
        if fatal:  # an allocation failed midway: the library's state is not trusted again
            return
