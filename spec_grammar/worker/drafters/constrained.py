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
from .base import Drafter, NoDrafter
from .forced import GrammarDraft, extend_with_forced, walk_tree
from .model import ModelDrafter, best_candidates, tree_from_candidates
from .ngram import NgramDrafter, ngram_tree
from .vocab_map import check_draft_vocab, draft_to_target_ids, draft_vocab_bitmask

__all__ = [
    "GrammarAwareDrafter",
    "make_grammar_drafter",
    "current_matcher",
    "DEFAULT_FORCED_TOKENS",
]

DEFAULT_FORCED_TOKENS = True
"""Default of ``forced_tokens`` in ``generate`` / ``build_worker`` / ``spec-grammar generate``,
chosen with ``benchmarks/bench_drafting.py`` (``benchmarks/results/drafting.md``: n-gram +
forced tokens on xgrammar, BFCL: accept length 3.43 vs 2.17, 5.2 vs 2.9 tok/s)."""


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
    needs_grammar_state = True
    """The worker advances matchers with the committed tokens before :meth:`propose`."""

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
        ``tree`` may be the proposed tree cut to a smaller depth (the worker's token budget)."""
        got = self._rows.get(rid)
        if got is None:
            return None
        full, rows, valid = got
        if tree is full:
            return rows, valid
        max_depth = max(tree.depth_list)
        keep = [i for i, d in enumerate(full.depth_list) if d <= max_depth]
        if [full.token_list[i] for i in keep] != tree.token_list:
            return None
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

        Candidates keep a lazily made matcher fork and row; requests without a grammar get the
        unmasked tree. Per depth, the grammar rows of the whole batch's frontier go to the
        device in one upload and mask the draft log-probs there, before the batched top-k
        (:meth:`ModelDrafter.top_log_probs`). Returns per request ``(GrammarDraft,
        leaf_matcher)`` (grammar; see :func:`.forced.extend_with_forced`) or ``(DraftTree,
        None)`` (no grammar)."""
        d: ModelDrafter = self.inner  # type: ignore[assignment]
        budget = d.num_draft_tokens - 1
        root_rows = d._catch_up(batch)
        k = d.topk
        info = next((m.info for m in matchers if m is not None), None)
        if info is not None:
            check_draft_vocab(int(root_rows.shape[1]), info.vocab_size, self.d2t)
        # Per request: candidates (token, parent or -1, score, depth) and their grammar state.
        cands: list[list[tuple[int, int, float, int]]] = []
        states: list[dict[int, tuple[Any, torch.Tensor, bool]]] = []
        roots: list[tuple[Any, torch.Tensor] | None] = []
        frontiers: list[list[int]] = []

        def state(i: int, c: int):
            """(matcher, row (W,), terminated) after root..candidate c of request i."""
            st = states[i]
            if c not in st:
                tok, parent, _, _ = cands[i][c]
                pm = roots[i][0] if parent == -1 else state(i, parent)[0]
                m = pm.fork()
                row = torch.zeros(info.bitmask_width, dtype=torch.int32)
                ok = m.accept_token(tok)
                if ok and not m.is_terminated():
                    m.fill_next_token_bitmask(row.unsqueeze(0), 0)
                st[c] = (m, row, not ok or m.is_terminated())
            return st[c]

        def top(rows: torch.Tensor, grammar_rows: list[torch.Tensor | None]):
            """Per row of ``rows``: (log-probs, target ids) of its top-k allowed tokens."""
            masked = [j for j, r in enumerate(grammar_rows) if r is not None]
            bitmask = None
            if masked:
                bitmask = torch.stack([grammar_rows[j] for j in masked])
                if self.d2t is not None:
                    bitmask = draft_vocab_bitmask(bitmask, self.d2t, info.vocab_size)
            values, ids = d.top_log_probs(
                rows, k, bitmask, None if len(masked) == len(grammar_rows) else masked
            )
            if self.d2t is not None:
                ids = draft_to_target_ids(ids, self.d2t)
            return zip(values.tolist(), ids.tolist())

        def expand(top_row, base: float, parent: int):
            vs, ts = top_row
            return [(base + v, t, parent) for v, t in zip(vs, ts) if v != float("-inf")]

        root_masks = []
        for m in matchers:
            root_row = None
            if m is not None:
                root_row = torch.zeros(info.bitmask_width, dtype=torch.int32)
                m.fill_next_token_bitmask(root_row.unsqueeze(0), 0)
            roots.append(None if m is None else (m, root_row))
            root_masks.append(root_row)
            states.append({})
        for top_row in top(root_rows, root_masks):
            new = expand(top_row, 0.0, -1)
            cands.append([(t, -1, s, 1) for s, t, _ in new])
            frontiers.append(list(range(len(new))))
        rids = [s.rid for s in batch]
        for _ in range(1, d.num_steps):
            if budget == 0:
                break
            logits, index_of = d.forward_spines(batch, rids, cands, frontiers)
            # The frontier nodes to expand: (request, candidate, grammar row); terminated
            # grammar states have no continuation.
            live: list[tuple[int, int, torch.Tensor | None]] = []
            for i, front in enumerate(frontiers):
                for f in front:
                    row = None
                    if roots[i] is not None:
                        _, row, terminated = state(i, f)
                        if terminated:
                            continue
                    live.append((i, f, row))
            tops = []
            if live:
                rows = d.gather_rows(logits, [(i, index_of[i][f]) for i, f, _ in live])
                tops = top(rows, [row for _, _, row in live])
            news: list[list[tuple[float, int, int]]] = [[] for _ in batch]
            for (i, f, _), top_row in zip(live, tops):
                news[i].extend(expand(top_row, cands[i][f][2], f))
            for i, (c, front, new) in enumerate(zip(cands, frontiers, news)):
                new.sort(key=lambda x: -x[0])
                if not new:
                    frontiers[i] = []
                    continue
                depth = c[front[0]][3] + 1
                start = len(c)
                c.extend((t, f, score, depth) for score, t, f in new)
                frontiers[i] = list(range(start, start + min(k, len(new))))
        out: list[tuple[Any, Any]] = []
        for i, s in enumerate(batch):
            order = best_candidates(cands[i], budget)
            if roots[i] is None:
                out.append((tree_from_candidates(s.root_token, cands[i], order)[0], None))
                continue
            node_of = [-1]
            index = {}
            draft = GrammarDraft([s.root_token], [-1], [False], [roots[i][1]])
            for j in order:
                tok, p, _, _ = cands[i][j]
                _, row, terminated = state(i, j)
                index[j] = draft.add(tok, 0 if p == -1 else index[p], row, terminated)
                node_of.append(j)

            def at(n: int, i=i, node_of=node_of):
                return (roots[i][0] if n == 0 else state(i, node_of[n])[0]).fork()

            out.append((draft, at))
        return out


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
