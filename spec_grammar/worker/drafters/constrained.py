"""Grammar-aware drafting: constrained draft trees, grammar-forced tokens, row reuse.

:class:`GrammarAwareDrafter` wraps any drafter (``ngram``, ``self:L``, ``model:PATH``, or none
for ``--draft grammar``). Per request with a grammar, at the state after every committed token
(the worker advances the matchers BEFORE drafting when this drafter is used):

- ``constrain``: only tokens the grammar allows enter the tree. A draft model's logits of
  every frontier node are masked with that node's grammar row before the top-k selection
  (each branch holds a fork of the request's matcher); other drafters' trees are walked with
  the matcher and their invalid nodes dropped (the n-gram drafter is asked for
  ``overfetch`` times the node budget first, so dropped nodes leave room for valid ones). The
  rows computed on the way are the verification rows of the tree:
  :meth:`GrammarAwareDrafter.draft_rows` hands them to the worker, which then skips its own
  tree fill for that request (no second traversal).
- ``forced``: every leaf is extended with the grammar's forced continuation
  (:mod:`.forced`) within ``num_draft_tokens``.

Neither changes outputs: every node still goes through target verification. Constrained
model drafting follows SGLang's grammar-constrained EAGLE draft discussion
(sgl-project/sglang#4329); the draft-vocabulary translation is :mod:`.vocab_map`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...tree import DraftTree
from ..defaults import DEFAULT_FORCED_TOKENS  # re-exported: its documented home
from .base import Drafter, NoDrafter
from .forced import GrammarDraft, extend_with_forced, walk_tree
from .model import Children, ModelDrafter, best_candidates, tree_from_candidates
from .ngram import NgramDrafter, ngram_tree
from .vocab_map import check_draft_vocab, draft_to_target_ids, draft_vocab_bitmask

__all__ = [
    "GrammarAwareDrafter",
    "make_grammar_drafter",
    "current_matcher",
    "DEFAULT_FORCED_TOKENS",
]


def current_matcher(state: Any) -> Any:
    """A fork of ``state.matcher`` at the state after every committed token (the pending
    tokens the worker has not fed yet are accepted on the fork); None when the request has
    no grammar or its grammar has terminated."""
    m = state.matcher
    if m is None:
        return None
    m = m.fork()
    if state.pending and m.accept_tokens(state.pending) != len(state.pending):
        return None
    return None if m.is_terminated() else m


class GrammarAwareDrafter(Drafter):
    """Constrained and/or forced-token drafting around ``inner`` (see the module docstring).

    Args:
        inner: the drafter whose trees are constrained / extended (:class:`NoDrafter` for
            forced tokens alone, ``--draft grammar``).
        num_draft_tokens: node cap per tree, root included.
        constrain: grammar-masked drafting with row reuse.
        forced: extend leaves with grammar-forced tokens.
        overfetch: n-gram trees are first built with ``overfetch * num_draft_tokens`` nodes
            when constraining (invalid nodes are then dropped).
        d2t: draft-to-target id offsets for a draft model with its own vocabulary
            (:mod:`.vocab_map`); a model drafter whose logits width differs from the
            grammar's without it raises :class:`~.vocab_map.DraftVocabError` at the first step.
    """

    name = "grammar"
    needs_grammar_state = True  # matchers advanced before :meth:`propose` (drafts from them)

    def __init__(
        self,
        inner: Drafter | None,
        *,
        num_draft_tokens: int = 8,
        constrain: bool = True,
        forced: bool = True,
        overfetch: int = 4,
        d2t: torch.Tensor | None = None,
    ):
        super().__init__(num_draft_tokens=num_draft_tokens)
        self.inner = inner if inner is not None else NoDrafter()
        self.constrain = bool(constrain)
        self.forced = bool(forced)
        self.overfetch = int(overfetch)
        self.d2t = d2t
        self._rows: dict[str, tuple[DraftTree, torch.Tensor, torch.Tensor]] = {}
        self.forced_added = 0
        """Forced tokens added to trees since construction (for benchmarks)."""

    def add(self, state) -> None:
        self.inner.add(state)

    def add_batch(self, states) -> dict:
        return self.inner.add_batch(states)

    def remove(self, rid: str) -> None:
        self.inner.remove(rid)
        self._rows.pop(rid, None)

    # -- the worker's side of row reuse ------------------------------------------------------
    def draft_rows(self, rid: str, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verification rows of ``tree`` computed while drafting it: ``(bitmask (N, W)
        int32, valid (N,) bool)``, or None when none were kept (no grammar, no ``constrain``).
        ``tree`` may be a subtree of the proposed one (:meth:`DraftTree.subtree`: the worker's
        token and draft budgets cut trees): a row depends only on its token path, so each node
        takes the row of the proposed node with the same path; None when one has none."""
        got = self._rows.get(rid)
        if got is None:
            return None
        full, rows, valid = got
        if tree is full:
            return rows, valid
        by_path = {(full.parent_list[i], full.token_list[i]): i for i in range(full.num_nodes)}
        keep = [0] * tree.num_nodes
        for i in range(1, tree.num_nodes):
            node = by_path.get((keep[tree.parent_list[i]], tree.token_list[i]))
            if node is None:
                return None
            keep[i] = node
        return rows[keep], valid[keep]

    # -- drafting ----------------------------------------------------------------------------
    def propose(self, batch: Sequence[Any]) -> list[DraftTree]:
        self._rows.clear()
        matchers = [current_matcher(s) for s in batch]
        budget = self.num_draft_tokens - 1
        if self.constrain and isinstance(self.inner, ModelDrafter):
            drafts = self._constrained_model(batch, matchers)
        else:
            drafts = []
            for m, t in zip(matchers, self._inner_trees(batch, matchers)):
                if m is None:
                    drafts.append((t, None))
                else:
                    d = walk_tree(m, t, budget, fill_rows=self.constrain)
                    drafts.append((d, self._replayer(m, d)))
        out = []
        for s, (d, leaf_matcher) in zip(batch, drafts):
            if isinstance(d, DraftTree):
                out.append(d)
                continue
            if self.forced:
                self.forced_added += extend_with_forced(d, leaf_matcher, budget)
            tree = d.tree()
            if self.constrain:
                self._rows[s.rid] = (
                    tree,
                    d.bitmask(),
                    torch.ones(tree.num_nodes, dtype=torch.bool),
                )
            out.append(tree)
        return out

    def _inner_trees(self, batch, matchers) -> list[DraftTree]:
        if self.constrain and isinstance(self.inner, NgramDrafter):
            big = self.overfetch * self.num_draft_tokens
            trees = [
                ngram_tree(
                    s.committed_array(),
                    big if m is not None else self.inner.num_draft_tokens,
                    max_match=self.inner.max_match,
                    min_match=self.inner.min_match,
                    max_depth=self.inner.max_depth
                    if self.inner.max_depth is not None
                    else self.num_draft_tokens - 1,
                )
                for s, m in zip(batch, matchers)
            ]
        else:
            trees = self.inner.propose(batch)
        return trees

    @staticmethod
    def _replayer(root: Any, draft: GrammarDraft):
        def at(node: int):
            m = root.fork()
            path = draft.path(node)
            return m if m.accept_tokens(path) == len(path) else None

        return at

    # -- constrained EAGLE-2-style model drafting ----------------------------------------------
    def _constrained_model(self, batch, matchers) -> list[Any]:
        """:meth:`ModelDrafter.propose` with every frontier row masked by its grammar row.

        Candidates keep a lazily made matcher fork and row (:class:`_GrammarStates`); requests
        without a grammar get the unmasked tree. Per depth, the grammar rows of the whole
        batch's frontier go to the device in one upload and mask the draft log-probs there,
        before the batched top-k (:meth:`ModelDrafter.top_log_probs`); the expansion itself is
        the plain drafter's (:meth:`ModelDrafter.expand`). Returns per request
        ``(GrammarDraft, leaf_matcher)`` (grammar; see :func:`.forced.extend_with_forced`) or
        ``(DraftTree, None)`` (no grammar)."""
        d: ModelDrafter = self.inner  # type: ignore[assignment]
        budget = d.num_draft_tokens - 1
        root_rows = d._catch_up(batch)
        info = next((m.info for m in matchers if m is not None), None)
        if info is not None:
            check_draft_vocab(int(root_rows.shape[1]), info.vocab_size, self.d2t)
        vocab, width = (info.vocab_size, info.bitmask_width) if info is not None else (0, 0)
        grammar = _GrammarStates(matchers, width)
        root_tops = self._masked_top(root_rows, grammar.root_rows(), vocab)
        roots = [[(-1, vs, ts)] for vs, ts in root_tops]

        def children(logits, index_of, cands, frontiers) -> list[Children]:
            # the frontier nodes to expand, with their grammar rows; terminated grammar states
            # have no continuation
            live: list[tuple[int, int, torch.Tensor | None]] = []
            for i, front in enumerate(frontiers):
                for f in front:
                    row = None
                    if grammar.has(i):
                        _, row, terminated = grammar.state(i, f, cands[i])
                        if terminated:
                            continue
                    live.append((i, f, row))
            kids: list[Children] = [[] for _ in batch]
            if live:
                rows = d.gather_rows(logits, [(i, index_of[i][f]) for i, f, _ in live])
                tops = self._masked_top(rows, [row for _, _, row in live], vocab)
                for (i, f, _), (vs, ts) in zip(live, tops):
                    kids[i].append((f, vs, ts))
            return kids

        cands = d.expand(batch, roots, children, d.num_steps if budget else 1)
        return [
            self._grammar_draft(s, i, cands[i], best_candidates(cands[i], budget), grammar)
            for i, s in enumerate(batch)
        ]

    def _masked_top(
        self, rows: torch.Tensor, grammar_rows: list[torch.Tensor | None], vocab_size: int
    ) -> list:
        """Per row of ``rows`` (draft logits on the device): ``(log-probs, target ids)`` of its
        top-k tokens among those its grammar row (None: no grammar; a ``vocab_size``-token
        target-vocabulary row otherwise) allows."""
        d: ModelDrafter = self.inner  # type: ignore[assignment]
        masked = [j for j, r in enumerate(grammar_rows) if r is not None]
        bitmask = None
        if masked:
            bitmask = torch.stack([grammar_rows[j] for j in masked])
            if self.d2t is not None:
                bitmask = draft_vocab_bitmask(bitmask, self.d2t, vocab_size)
        values, ids = d.top_log_probs(
            rows, d.topk, bitmask, None if len(masked) == len(grammar_rows) else masked
        )
        if self.d2t is not None:
            ids = draft_to_target_ids(ids, self.d2t)
        return list(zip(values.tolist(), ids.tolist()))

    @staticmethod
    def _grammar_draft(s, i: int, cands, order: list[int], grammar: _GrammarStates):
        """Request ``i``'s draft of the candidates ``order``: ``(DraftTree, None)`` without a
        grammar, else ``(GrammarDraft, leaf_matcher)`` with every node's grammar row."""
        if not grammar.has(i):
            return tree_from_candidates(s.root_token, cands, order)[0], None
        root_matcher, root_row = grammar.roots[i]
        node_of = [-1]
        index = {}
        draft = GrammarDraft([s.root_token], [-1], [False], [root_row])
        for j in order:
            tok, p, _, _ = cands[j]
            _, row, terminated = grammar.state(i, j, cands)
            index[j] = draft.add(tok, 0 if p == -1 else index[p], row, terminated)
            node_of.append(j)

        def at(n: int):
            return (root_matcher if n == 0 else grammar.state(i, node_of[n], cands)[0]).fork()

        return draft, at


class _GrammarStates:
    """The grammar state of a constrained model draft's candidates, made when first needed.

    Per request ``i``: the root's ``(matcher, row (W,) int32)`` (None without a grammar) and,
    per candidate, ``(matcher fork, row, terminated)`` after the path root..candidate."""

    def __init__(self, matchers: Sequence[Any], width: int):
        self.width = width
        self.roots: list[tuple[Any, torch.Tensor] | None] = []
        for m in matchers:
            root = None
            if m is not None:
                row = torch.zeros(width, dtype=torch.int32)
                m.fill_next_token_bitmask(row.unsqueeze(0), 0)
                root = (m, row)
            self.roots.append(root)
        self._states: list[dict[int, tuple[Any, torch.Tensor, bool]]] = [{} for _ in matchers]

    def has(self, i: int) -> bool:
        """Whether request ``i`` has a grammar."""
        return self.roots[i] is not None

    def root_rows(self) -> list[torch.Tensor | None]:
        return [None if root is None else root[1] for root in self.roots]

    def state(self, i: int, c: int, cands) -> tuple[Any, torch.Tensor, bool]:
        """(matcher, row, terminated) after root..candidate ``c`` of request ``i``
        (``cands``: its candidates)."""
        states = self._states[i]
        if c not in states:
            tok, parent, _, _ = cands[c]
            pm = self.roots[i][0] if parent == -1 else self.state(i, parent, cands)[0]
            m = pm.fork()
            row = torch.zeros(self.width, dtype=torch.int32)
            ok = m.accept_token(tok)
            if ok and not m.is_terminated():
                m.fill_next_token_bitmask(row.unsqueeze(0), 0)
            states[c] = (m, row, not ok or m.is_terminated())
        return states[c]


def make_grammar_drafter(
    draft: str | Drafter | None,
    *,
    constrain_draft: bool = False,
    forced_tokens: bool = False,
    num_draft_tokens: int = 8,
    **make_kwargs: Any,
) -> Drafter:
    """The drafter named by ``draft`` (:func:`~spec_grammar.worker.drafters.make_drafter`
    names, plus ``grammar`` = forced tokens alone), wrapped in a :class:`GrammarAwareDrafter`
    when ``constrain_draft`` or ``forced_tokens`` is set (``grammar`` always is)."""
    from . import make_drafter

    if draft == "grammar":
        return GrammarAwareDrafter(
            NoDrafter(), num_draft_tokens=num_draft_tokens, constrain=constrain_draft, forced=True
        )
    inner = make_drafter(draft, num_draft_tokens=num_draft_tokens, **make_kwargs)
    if not (constrain_draft or forced_tokens) or isinstance(inner, NoDrafter):
        return inner
    return GrammarAwareDrafter(
        inner, num_draft_tokens=num_draft_tokens, constrain=constrain_draft, forced=forced_tokens
    )
