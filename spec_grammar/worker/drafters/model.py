"""Draft-model drafting with EAGLE-2-style dynamic trees.

Two sources of draft model:

- ``self:L`` (:func:`truncated_model`): the target's first ``L`` decoder layers + its final
  norm + LM head, sharing the target's weights (no extra memory, untrained, so acceptance is
  modest; a "self-speculative" early-exit drafter as in LayerSkip / Draft & Verify).
- ``model:PATH``: any smaller causal LM sharing the target's tokenizer, loaded with
  :func:`spec_grammar.models.load_model` (a model directory, a ``.gguf`` file or a known name).

Tree construction follows EAGLE-2 (Li et al., "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees", 2024) as SGLang implements it (``eagle_utils.organize_draft_results``):
step 1 takes the root's ``topk`` most likely tokens; each later step expands the ``topk``
frontier nodes with their ``topk`` children each and keeps the ``topk`` best of those
``topk**2`` candidates (by cumulative draft log-probability) as the next frontier; after
``num_steps`` steps the ``num_draft_tokens - 1`` best candidates overall (parents always
before their children, since log-probabilities only fall along a path) form the tree.
``topk=1`` gives a chain of ``min(num_steps, num_draft_tokens - 1)`` tokens.

The draft model runs on its own :class:`~spec_grammar.worker.runner.ModelRunner`: every step
first catches its cache up with the tokens the target committed since the last step (a chain
forward), then runs one forward per draft depth over the frontier and its ancestors.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from ...tree import DraftTree
from .base import Drafter

__all__ = ["ModelDrafter", "truncated_model"]


def truncated_model(model: Any, num_layers: int) -> Any:
    """A causal LM made of ``model``'s first ``num_layers`` decoder layers, final norm and LM
    head, sharing every weight with ``model`` (nothing is copied but module containers).

    Works for decoder-only ``transformers`` models with ``model.model.layers`` (Llama,
    Mistral, Qwen, Gemma, SmolLM). Raises ``ValueError`` for other layouts or an ``L`` outside
    ``[1, num_hidden_layers]``.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"self-drafting needs a decoder with model.model.layers; got {type(model).__name__}")
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"self:L needs 1 <= L <= {total} (the target's layers), got L={num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:num_layers]
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    new_inner.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.model = new_inner
    draft.config = config
    return draft


def best_candidates(cands, budget: int) -> list[int]:
    """Indices of the ``budget`` best draft candidates by cumulative log-prob (EAGLE-2's
    re-ranking), closed under parents, in (depth, index) order. ``cands[j]`` =
    ``(token, parent candidate or -1, cumulative log-prob, depth)``."""
    ranked = sorted(range(len(cands)), key=lambda j: (-cands[j][2], cands[j][3], j))
    chosen: set[int] = set()
    for j in ranked:
        if len(chosen) == budget:
            break
        p = cands[j][1]
        if p == -1 or p in chosen:
            chosen.add(j)
    return sorted(chosen, key=lambda j: (cands[j][3], j))


def tree_from_candidates(root: int, cands, order: list[int]) -> DraftTree:
    """The draft tree of the candidates ``order`` (parents before children) under ``root``."""
    index = {}
    tokens, parents = [root], [-1]
    for j in order:
        index[j] = len(tokens)
        tokens.append(cands[j][0])
        p = cands[j][1]
        parents.append(0 if p == -1 else index[p])
    return DraftTree(tokens, parents)


class ModelDrafter(Drafter):
    """EAGLE-2-style draft trees from a draft causal LM (see the module docstring).

    Args:
        runner: a :class:`~spec_grammar.worker.runner.ModelRunner` over the draft model.
        topk: branches per expanded node and frontier width (1 = chain).
        num_steps: draft depth (draft forwards per step, after the catch-up forward).
        num_draft_tokens: node cap per tree, root included.
        vocab_limit: draft tokens are restricted to ids below this (the target's logits
            width), so a draft model with a larger vocabulary never proposes unknown ids.

    Raises ``ValueError`` on non-positive ``topk`` / ``num_steps``.
    """

    name = "model"

    def __init__(
        self,
        runner: Any,
        *,
        topk: int = 1,
        num_steps: int = 4,
        num_draft_tokens: int = 8,
        vocab_limit: int | None = None,
    ):
        super().__init__(num_draft_tokens=num_draft_tokens)
        if topk < 1 or num_steps < 1:
            raise ValueError(f"topk and num_steps must be >= 1, got topk={topk}, num_steps={num_steps}")
        self.runner = runner
        self.topk = int(topk)
        self.num_steps = int(num_steps)
        self.vocab_limit = vocab_limit

    def add(self, state) -> None:
        self.runner.add(state.rid, list(state.prompt_ids))

    def remove(self, rid: str) -> None:
        self.runner.remove(rid)

    def _log_probs(self, row: torch.Tensor) -> torch.Tensor:
        row = row.float()
        if self.vocab_limit is not None:
            row = row[: self.vocab_limit]
        return torch.log_softmax(row, dim=-1).cpu()

    def _catch_up(self, batch: Sequence[Any]) -> list[torch.Tensor]:
        """Feed each request's committed-but-uncached tokens; returns the root's log-probs."""
        rids = [s.rid for s in batch]
        chains = []
        for s in batch:
            pending = s.committed_ids[self.runner.cache_len(s.rid) :]
            chains.append(DraftTree.chain(pending[0], pending[1:]))
        logits = self.runner.forward_trees(rids, chains)
        out = []
        for i, (s, chain) in enumerate(zip(batch, chains)):
            m = chain.num_nodes
            out.append(self._log_probs(logits[i, m - 1]))
            if m > 1:
                # Keep every committed token but the last: it is the next tree's root.
                self.runner.commit(s.rid, list(range(m - 1)))
        return out

    def propose(self, batch) -> list[DraftTree]:
        if not batch:
            return []
        budget = self.num_draft_tokens - 1
        root_lp = self._catch_up(batch)
        if budget == 0:
            return [DraftTree.chain(s.root_token, []) for s in batch]
        k = self.topk
        # Per request: candidate nodes (token, parent candidate index or -1 = root, score, depth).
        cands: list[list[tuple[int, int, float, int]]] = []
        frontiers: list[list[int]] = []
        for lp in root_lp:
            top = torch.topk(lp, k)
            c = [(int(t), -1, float(v), 1) for v, t in zip(top.values, top.indices)]
            cands.append(c)
            frontiers.append(list(range(len(c))))
        rids = [s.rid for s in batch]
        for _ in range(1, self.num_steps):
            trees, index_of = [], []
            for s, c, front in zip(batch, cands, frontiers):
                tree, idx = self._spine_tree(s.root_token, c, front)
                trees.append(tree)
                index_of.append(idx)
            logits = self.runner.forward_trees(rids, trees)
            for i, (c, front) in enumerate(zip(cands, frontiers)):
                new: list[tuple[float, int, int]] = []
                for f in front:
                    lp = self._log_probs(logits[i, index_of[i][f]])
                    top = torch.topk(lp, k)
                    base = c[f][2]
                    new.extend((base + float(v), int(t), f) for v, t in zip(top.values, top.indices))
                new.sort(key=lambda x: -x[0])
                depth = c[front[0]][3] + 1
                start = len(c)
                c.extend((t, f, score, depth) for score, t, f in new)
                frontiers[i] = list(range(start, start + min(k, len(new))))
        return [self._select(s.root_token, c, budget) for s, c in zip(batch, cands)]

    @staticmethod
    def _spine_tree(root: int, cands, front: list[int]) -> tuple[DraftTree, dict[int, int]]:
        """The tree of the frontier nodes and their ancestors; maps candidate -> tree node."""
        keep: set[int] = set()
        for f in front:
            while f != -1 and f not in keep:
                keep.add(f)
                f = cands[f][1]
        order = sorted(keep, key=lambda j: (cands[j][3], j))
        index = {}
        tokens, parents = [root], [-1]
        for j in order:
            index[j] = len(tokens)
            tokens.append(cands[j][0])
            p = cands[j][1]
            parents.append(0 if p == -1 else index[p])
        return DraftTree(tokens, parents), index

    @staticmethod
    def _select(root: int, cands, budget: int) -> DraftTree:
        """The ``budget`` best candidates by cumulative log-prob, as a tree under ``root``."""
        return tree_from_candidates(root, cands, best_candidates(cands, budget))
