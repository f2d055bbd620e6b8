"""The naive tree fill engines use today, written directly against each library's API.

SGLang's ``traverse_tree`` (``speculative/spec_utils.py``, PR #6499): a recursive DFS over
first-child / next-sibling links; a node is accepted iff its token's bit is set in its
parent's row; an accepted node is ``accept_token``-ed, its row filled (unless the grammar
terminated), its first child visited, then ``rollback(1)``; siblings are visited with the
same parent row. It bypasses spec-grammar entirely (no protocol, no checks), so it is the
baseline our ``fill_tree_bitmasks`` is compared with. Links and tokens are read from Python
lists, not tensors (cheaper than SGLang's own 0-d tensor indexing: a lower bound for naive).

Each walker also exposes the library's own native tree call where one exists (xgrammar
``traverse_draft_tree``), to show how much of our cost is the library's.

The walkers reach into the adapters only for the library objects a compiled grammar holds
(xgrammar's ``CompiledGrammar``, llguidance's grammar text and ``LLTokenizer``, outlines-core's
``Index``); everything timed is a direct library call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.protocol import CompiledGrammar, GrammarBackend
from spec_grammar.tree import DraftTree

__all__ = ["NaiveWalker", "naive_walker"]


class NaiveWalker:
    """Library-API matcher factory plus the SGLang-pattern DFS for one compiled grammar.

    Subclasses implement :meth:`new_matcher`, :meth:`accept`, :meth:`fill`, :meth:`rollback`,
    :meth:`terminated`; ``native_tree`` is None or a callable
    ``(matcher, tree, rows) -> None`` (the library's one-call tree fill).
    """

    native_tree: Callable[[Any, DraftTree, torch.Tensor], None] | None = None
    semantics_note: str | None = None
    """Set when the library's raw masks differ from the protocol's rows by design: the naive
    walk then visits a subset of our valid nodes and rows are not compared."""

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        self.backend = backend
        self.compiled = compiled
        self.vocab = backend.tokenizer_info.tokenizer_vocab_size

    def new_matcher(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self, prefix: list[int]) -> Any:
        """A fresh library matcher that has accepted ``prefix``. Raises ``ValueError`` if the
        library refuses a prefix token."""
        m = self.new_matcher()
        for t in prefix:
            if not self.accept(m, t):
                raise ValueError(f"{self.backend.name} refused prefix token {t}")
        return m

    def ignored_ids(self) -> list[int]:
        """Token ids where the library's raw rows differ from the adapter's by design (left
        out when rows are compared)."""
        return []

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask this library can write: ``(rows, W)`` int32 with ``W = ceil(V/32)``
        unless the library needs more words per row."""
        return allocate_token_bitmask(rows, self.backend.vocab_size)

    def walk(
        self, m: Any, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> tuple[list[bool], list[bool]]:
        """SGLang ``traverse_tree`` on rows ``row_offset..row_offset+N-1`` of ``bitmask`` (from
        :meth:`allocate`). Returns ``(accepted, filled)`` flags per node; rows not filled are
        left as they were."""
        tokens = tree.token_list
        first_child = tree.first_child_list
        next_sibling = tree.next_sibling_list
        words = bitmask.numpy()
        vocab = self.vocab
        accepted_nodes = [False] * tree.num_nodes
        filled = [False] * tree.num_nodes
        accept, fill, rollback, terminated = self.accept, self.fill, self.rollback, self.terminated

        def dfs(curr: int, parent: int) -> None:
            if curr == 0:
                accepted = True
            else:
                t = tokens[curr]
                accepted = (
                    0 <= t < vocab and (int(words[row_offset + parent, t >> 5]) >> (t & 31)) & 1
                )
            if accepted:
                if curr != 0:
                    accept(m, tokens[curr])
                accepted_nodes[curr] = True
                if not terminated(m):
                    fill(m, bitmask, row_offset + curr)
                    filled[curr] = True
                    if first_child[curr] != -1:
                        dfs(first_child[curr], curr)
                if curr != 0:
                    rollback(m)
            if next_sibling[curr] != -1:
                dfs(next_sibling[curr], parent)

        dfs(0, -1)
        return accepted_nodes, filled

    # library operations ---------------------------------------------------------------------
    def accept(self, m: Any, token: int) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def rollback(self, m: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def terminated(self, m: Any) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class _XGrammarWalker(NaiveWalker):
    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        super().__init__(backend, compiled)
        import xgrammar as xgr

        self._xgr = xgr
        self.native_tree = self._traverse

    def new_matcher(self) -> Any:
        return self._xgr.GrammarMatcher(self.compiled.native)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, m: Any) -> None:
        m.rollback(1)

    def terminated(self, m: Any) -> bool:
        return m.is_terminated()

    @staticmethod
    def _traverse(m: Any, tree: DraftTree, rows: torch.Tensor) -> None:
        m.traverse_draft_tree(
            tree.retrieve_next_token, tree.retrieve_next_sibling, tree.tokens, rows
        )


class _LLGuidanceWalker(NaiveWalker):
    """``LLMatcher`` with ``consume_token`` / ``rollback`` and the ``llguidance.torch`` fill
    wrapper, as SGLang's llguidance grammar object uses them; terminated = ``is_stopped()``."""

    semantics_note = (
        "llguidance's raw masks allow only the canonical token where the grammar forces text "
        "(the adapter completes those rows), so the naive walk rejects some valid draft tokens "
        "and visits fewer nodes"
    )

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        super().__init__(backend, compiled)
        import llguidance
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._tokenizer = backend._llg_tokenizer
        self._text = compiled.native.text

    def new_matcher(self) -> Any:
        return self._llg.LLMatcher(self._tokenizer, self._text, log_level=0)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self._fill(m, bitmask, row)

    def rollback(self, m: Any) -> None:
        m.rollback(1)

    def terminated(self, m: Any) -> bool:
        return m.is_stopped()


class _OutlinesWalker(NaiveWalker):
    """outlines-core ``Guide`` over the adapter's ``Index``: ``write_mask_into``,
    ``advance(t, return_tokens=False)``, ``rollback_state(1)``. outlines-core has no notion of
    termination (and SGLang no outlines tree path), so nothing is treated as terminated. The
    Index holds the adapter's sentinel token at id ``V``, so rows get one extra word."""

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        super().__init__(backend, compiled)
        import outlines_core

        self._oc = outlines_core
        self._index = compiled.native.index
        self._words = (backend.vocab_size + 1 + 31) // 32

    def allocate(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self._words), -1, dtype=torch.int32)

    def ignored_ids(self) -> list[int]:
        # byte tokens that spell part of the sentinel: the raw Index allows them where the
        # grammar can end, the adapter refuses them
        return [int(t) for t in self.compiled.native._spelled_ids]

    def new_matcher(self) -> Any:
        return self._oc.Guide(self._index)

    def accept(self, m: Any, token: int) -> bool:
        m.advance(token, return_tokens=False)
        return True

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.write_mask_into(bitmask.data_ptr() + row * self._words * 4, self._words, 4)

    def rollback(self, m: Any) -> None:
        m.rollback_state(1)

    def terminated(self, m: Any) -> bool:
        return False


_WALKERS: dict[str, Callable[[GrammarBackend, CompiledGrammar], NaiveWalker]] = {
    "xgrammar": _XGrammarWalker,
    "llguidance": _LLGuidanceWalker,
    "outlines": _OutlinesWalker,
}


def naive_walker(backend: GrammarBackend, compiled: CompiledGrammar) -> NaiveWalker:
    """The naive walker for ``backend``'s library. Raises ``LookupError`` naming the reason
    when there is none (unknown library, or an adapter whose compiled object the walker cannot
    use)."""
    factory = _WALKERS.get(backend.name)
    if factory is None:
        raise LookupError(f"no library-API baseline written for backend {backend.name!r}")
    try:
        return factory(backend, compiled)
    except (AttributeError, TypeError, ImportError) as e:
        raise LookupError(f"library-API baseline for {backend.name!r} unavailable: {e}") from e
