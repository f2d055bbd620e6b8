"""One library matcher shared by a matcher and its forks: ``fork`` in O(1), whatever the
length of the output.

Why: xgrammar's ``GrammarMatcher.fork`` and llguidance's ``LLMatcher.deep_copy`` copy the
parser's whole history (every token accepted since the start; both keep it for unbounded
rollback). After 20,000 accepted tokens a fork cost 370x (xgrammar 0.2.9) and 31x (llguidance
1.9.1) what it cost after 50 (``benchmarks/spec_grammar_bench/long_history.py``), and a
draft tree forks once per branch every step. Both libraries roll back any number of tokens
and replay one in about a microsecond, so here a fork only records *where* it is: a
:class:`PathNode` (parent, token, depth) in the tree of accepted-token paths that it shares
with the matcher it was forked from. The library matcher is moved to a view's node when that
view is used (:meth:`SharedNative.enter`: roll back to the common ancestor, replay the view's
tokens from there), which costs the number of tokens the two views differ by (a draft
branch's depth), not the length of the output.

A view found further than ``detach_after`` tokens from the library matcher gets a library
copy of its own once it is there (one O(history) copy, what every fork cost before), so two
far-apart views used in turn pay their distance once, not on every switch.

Thread safety: every use of :attr:`SharedNative.native` must hold
:attr:`SharedNative.lock`; views of one shared native are used one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .errors import GrammarStateError

__all__ = ["PathNode", "SharedNative"]


class PathNode:
    """A position in the tree of accepted-token paths: ``token`` accepted after ``parent``
    (-1: not recorded), ``depth`` counted from where the library matcher was handed over (the
    first node: ``parent`` None)."""

    __slots__ = ("parent", "token", "depth")

    def __init__(self, parent: PathNode | None, token: int, depth: int):
        self.parent = parent
        self.token = token
        self.depth = depth

    def child(self, token: int) -> PathNode:
        """The node after accepting ``token`` here."""
        return PathNode(self, token, self.depth + 1)


def _route(src: PathNode, dst: PathNode) -> tuple[int, list[int]]:
    """From ``src`` to ``dst``: how many tokens to roll back (to their common ancestor) and
    the tokens to accept from there, in order. Costs the distance, not the depths."""
    up = 0
    down: list[int] = []
    while src.depth > dst.depth:
        src = src.parent  # type: ignore[assignment]
        up += 1
    while dst.depth > src.depth:
        down.append(dst.token)
        dst = dst.parent  # type: ignore[assignment]
    while src is not dst:
        src = src.parent  # type: ignore[assignment]
        up += 1
        down.append(dst.token)
        dst = dst.parent  # type: ignore[assignment]
    down.reverse()
    return up, down


class SharedNative:
    """A library matcher (:attr:`native`) and where it is (a :class:`PathNode`), shared by
    the views (a matcher and its forks) that hold a node of its tree.

    Args:
        native: the library matcher, at the state the :attr:`root` stands for.
        accept: ``accept(native, token) -> bool``, the library's accept (replay uses it).
        rollback: ``rollback(native, k)``, the library's rollback of ``k`` tokens.
        copy: ``copy(native) -> native``, an independent library copy.
        detach_after: a view moved further than this many tokens gets its own copy.
    """

    def __init__(
        self,
        native: Any,
        *,
        accept: Callable[[Any, int], bool],
        rollback: Callable[[Any, int], None],
        copy: Callable[[Any], Any],
        detach_after: int,
    ):
        self.native = native
        self.root = PathNode(None, -1, 0)
        self.lock = threading.RLock()
        self._at: PathNode | None = self.root  # None: unknown (after a failed library call)
        self._accept, self._rollback, self._copy = accept, rollback, copy
        self.detach_after = detach_after
        self.moves = 0  # tokens rolled back + replayed so far (tests, reports)
        self.copies = 0  # library copies made (detaches)

    def _move(self, native: Any, src: PathNode, dst: PathNode) -> int:
        up, down = _route(src, dst)
        if up:
            self._rollback(native, up)
        for t in down:
            if t < 0:
                raise GrammarStateError(
                    "a fork needs tokens accepted before its library matcher was handed over, "
                    "which were not recorded"
                )
            if not self._accept(native, t):
                raise GrammarStateError(
                    f"the library refused token {t} while replaying a path it had accepted"
                )
        self.moves += up + len(down)
        return up + len(down)

    def enter(self, node: PathNode) -> tuple[SharedNative, PathNode]:
        """Move :attr:`native` to ``node``; returns the ``(shared, node)`` the view holds from
        now on: this one, or a detached copy (at its root) after a move longer than
        ``detach_after``. The caller holds :attr:`lock`. Raises :class:`GrammarStateError`
        if the library refuses a token it accepted before."""
        if node is self._at:
            return self, node
        at = self._at
        if at is None:
            raise GrammarStateError(
                "the library matcher was left in an unknown state by an earlier failure"
            )
        self._at = None  # unknown until the move is done
        moved = self._move(self.native, at, node)
        self._at = node
        if moved <= self.detach_after:
            return self, node
        own = SharedNative(
            self._copy(self.native),
            accept=self._accept,
            rollback=self._rollback,
            copy=self._copy,
            detach_after=self.detach_after,
        )
        self.copies += 1
        # the last detach_after tokens come along, so the copy's own forks can replay them
        tokens = []
        while len(tokens) < self.detach_after and node.parent is not None:
            tokens.append(node.token)
            node = node.parent
        own.root.depth = -len(tokens)
        mine = own.root
        for t in reversed(tokens):
            mine = mine.child(t)
        own._at = mine
        return own, mine

    def up(self, node: PathNode, k: int) -> PathNode:
        """The node ``k`` tokens before ``node``. Past the root (a library matcher handed over
        with a history of its own, which rollback may undo) the root gets parents whose tokens
        are unknown: the library matcher can roll back to them, not replay from them."""
        with self.lock:
            for _ in range(k):
                if node.parent is None:
                    node.parent = PathNode(None, -1, node.depth - 1)
                    self.root = node.parent
                node = node.parent
        return node

    def pushed(self, node: PathNode, token: int) -> PathNode:
        """Record that :attr:`native`, at ``node``, accepted ``token``; returns the new node."""
        child = node.child(token)
        self._at = child
        return child
