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

Host traffic per depth (:meth:`ModelDrafter.top_log_probs`): the frontier rows of the whole
batch get their log-softmax, grammar mask (constrained drafting) and top-k on the drafter's
device; on CUDA only the ``(rows, k)`` values and indices come back, by non-blocking copies
into reused page-locked buffers followed by ONE CUDA event wait, the only wait per depth (the
host needs them to pick the next depth's frontier). Nothing of vocabulary size crosses to the
host.

Ties: on the CPU the batched path is bit-for-bit the old per-row path (float32 log-softmax of
each row, then ``torch.topk`` per row: ATen's CPU top-k treats every row of a batch
independently with the same algorithm, so tied log-probs come out in the same order).
``torch.topk`` on CUDA may order EXACTLY tied float32 log-probs differently from the CPU, so a
CUDA drafter equals a CPU one up to the choice among exactly tied log-probs (like any top-k
choice, that changes only the draft, never the verified output). With float64 models exact
float32 ties are not seen in practice (``tests/test_worker_gpu.py`` compares CUDA and CPU
trees); bf16 logits tie often (a random-weight bf16 SmolLM2-shaped drafter on an H200: 49 of
256 rows tied at the 4th value; the top-k values always agreed with the host path).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ...kernels import apply_token_bitmask_inplace
from ...tree import DraftTree
from .base import Drafter

__all__ = ["ModelDrafter", "truncated_model", "expand_frontier", "Candidate", "Children"]


class _Staging:
    """Reused host buffers for the drafter's small host <-> device copies.

    On CUDA, uploads go through page-locked buffers with ``non_blocking=True`` (a copy from
    pageable memory would synchronize the stream, waiting for the draft forward) and downloads
    land in page-locked buffers followed by one event wait. A buffer is rewritten only once
    the copy that last read it has finished (its event); each :meth:`download` ends with a
    wait covering every earlier copy, so in the drafting loop those checks never block.
    Elsewhere tensors simply move (a no-op on the CPU).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._events: dict[str, Any] = {}

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        event = self._events.pop(name, None)
        if event is not None:
            event.synchronize()
        buf = self._buffers.get(name)
        n = like.numel()
        if buf is None or buf.dtype != like.dtype or buf.numel() < n:
            # powers of two: a growing batch reallocates O(log n) times, not every depth
            buf = torch.empty(1 << max(n - 1, 0).bit_length(), dtype=like.dtype, pin_memory=True)
            self._buffers[name] = buf
        return buf[:n].view(like.shape)

    def _record(self, name: str) -> None:
        event = self._events[name] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))

    def upload(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a CPU tensor) on the device, without blocking the host on CUDA."""
        if not self.cuda:
            return host.to(self.device)
        buf = self._buffer(name, host)
        buf.copy_(host)
        out = buf.to(self.device, non_blocking=True)
        self._record(name)
        return out

    def download(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of small device tensors: one non-blocking copy each, then one wait."""
        if not self.cuda:
            return [t.cpu() for t in tensors]
        names = [f"down{j}" for j in range(len(tensors))]
        bufs = [self._buffer(n, t) for n, t in zip(names, tensors)]
        for buf, t in zip(bufs, tensors):
            buf.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        event.synchronize()
        self._events.clear()  # that wait covered every copy queued before it
        return [b.clone() for b in bufs]


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
        raise ValueError(
            f"self-drafting needs a decoder with model.model.layers; got {type(model).__name__}"
        )
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise ValueError(
            f"self:L needs 1 <= L <= {total} (the target's layers), got L={num_layers}"
        )
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


Candidate = tuple[int, int, float, int]
"""A draft-tree candidate: ``(token, parent candidate index or -1 = the root, cumulative draft
log-prob, depth)``."""

Children = list[tuple[int, Sequence[float], Sequence[int]]]
"""The expanded nodes of one request at one depth: ``(candidate index or -1 = the root, top-k
log-probs, their token ids)`` each."""


def expand_frontier(cands: list[Candidate], children: Iterable, k: int) -> list[int]:
    """One EAGLE-2 expansion of one request's candidates: every expanded node's top-k children
    (``children``, see :data:`Children`) are scored by cumulative log-prob (the parent's plus
    their own; ``-inf`` ones, tokens a grammar mask forbids, are dropped) and appended to
    ``cands`` best first (ties in expansion order); returns the next frontier, the indices of
    the ``k`` best new candidates."""
    new: list[tuple[float, int, int]] = []
    depth = 1
    for parent, values, ids in children:
        base, depth = (0.0, 1) if parent == -1 else (cands[parent][2], cands[parent][3] + 1)
        new.extend((base + v, t, parent) for v, t in zip(values, ids) if v != float("-inf"))
    new.sort(key=lambda x: -x[0])
    start = len(cands)
    cands.extend((t, parent, score, depth) for score, t, parent in new)
    return list(range(start, start + min(k, len(new))))


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


def tree_from_candidates(root: int, cands, order: list[int]) -> tuple[DraftTree, dict[int, int]]:
    """The draft tree of the candidates ``order`` (parents before children) under ``root``,
    and the map candidate index -> tree node."""
    index = {}
    tokens, parents = [root], [-1]
    for j in order:
        index[j] = len(tokens)
        tokens.append(cands[j][0])
        p = cands[j][1]
        parents.append(0 if p == -1 else index[p])
    return DraftTree(tokens, parents), index


class ModelDrafter(Drafter):
    """EAGLE-2-style draft trees from a draft causal LM (see the module docstring).

    Args:
        runner: a :class:`~spec_grammar.worker.runner.ModelRunner` over the draft model.
        topk: branches per expanded node and frontier width (1 = chain).
        num_steps: draft depth (draft forwards per step, after the catch-up forward).
        num_draft_tokens: node cap per tree, root included.
        vocab_limit: draft tokens are restricted to ids below this (the target's logits
            width), so a draft model with a larger vocabulary never proposes unknown ids.

    ``topk`` and ``num_steps`` are capped at ``num_draft_tokens - 1`` (at least 1): beyond it
    they would draft only candidates no tree can hold. Raises ``ValueError`` on non-positive
    ``topk`` / ``num_steps``.
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
            raise ValueError(
                f"topk and num_steps must be >= 1, got topk={topk}, num_steps={num_steps}"
            )
        self.runner = runner
        # A tree holds num_draft_tokens - 1 drafts and a candidate is chosen only with all its
        # ancestors, so no candidate deeper than that, nor ranked past it among its siblings or
        # its depth, is ever chosen (ties aside): a larger topk / num_steps is only work (topk=10**6 or
        # num_steps=10**9 would draft for ever), capped here.
        cap = max(self.num_draft_tokens - 1, 1)
        self.topk = min(int(topk), cap)
        self.num_steps = min(int(num_steps), cap)
        self.vocab_limit = vocab_limit
        self._staging = _Staging(torch.device(runner.device))

    def add(self, state) -> None:
        self.runner.add(state.rid, list(state.prompt_ids))

    def add_batch(self, states) -> dict:
        """The requests' prompts prefilled together (:meth:`ModelRunner.add_batch`)."""
        return self.runner.add_batch([(st.rid, list(st.prompt_ids)) for st in states])

    def remove(self, rid: str) -> None:
        if rid in self.runner.request_ids:  # a request this runner refused was never in it
            self.runner.remove(rid)

    def gather_rows(self, logits: torch.Tensor, nodes: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The draft logits of tree nodes, for the whole batch at once.

        Args:
            logits: ``(B, N, V)`` float32 from the runner's ``forward_trees``, on its device.
            nodes: ``(request index, tree node)`` pairs.

        Returns ``(len(nodes), V')`` float32 on the same device, ``V' = min(V, vocab_limit)``
        (one index upload, one gather; no host synchronization).
        """
        b, n, v = logits.shape
        width = v if self.vocab_limit is None else min(v, self.vocab_limit)
        flat = torch.tensor([i * n + node for i, node in nodes], dtype=torch.long)
        return (
            logits.reshape(b * n, v)[:, :width]
            .index_select(0, self._staging.upload("rows", flat))
            .float()
        )

    def top_log_probs(
        self,
        rows: torch.Tensor,
        k: int,
        bitmask: torch.Tensor | None = None,
        masked: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely draft tokens of each row: the only draft data the host reads.

        Args:
            rows: ``(R, V)`` float32 draft logits on the drafter's device (:meth:`gather_rows`).
            k: tokens per row; ``min(k, V)`` are returned.
            bitmask: ``(M, ceil(V / 32))`` int32 host grammar rows in the draft vocabulary, or
                None. Disallowed tokens get log-prob ``-inf`` AFTER the log-softmax over all
                ``V`` tokens (scores stay draft-model log-probs).
            masked: the rows of ``rows`` the ``M`` bitmask rows belong to (distinct); None =
                every row (``M == R``).

        Returns ``(values, indices)``: ``(R, min(k, V))`` float32 log-probs (descending) and
        int64 token ids, on the host. Log-softmax, mask and top-k run on the device; on CUDA
        the bitmask goes up non-blocking from page-locked memory and the results come back by
        non-blocking copies and one event wait (see the module docstring on ties).
        """
        staging = self._staging
        lp = torch.log_softmax(rows, dim=-1)
        if bitmask is not None and bitmask.shape[0]:
            idx = (
                None
                if masked is None
                else staging.upload("masked", torch.tensor(list(masked), dtype=torch.long))
            )
            apply_token_bitmask_inplace(lp, staging.upload("mask", bitmask), indices=idx)
        top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        values, indices = staging.download(top.values, top.indices)
        return values, indices

    def _catch_up(self, batch: Sequence[Any]) -> torch.Tensor:
        """Feed each request's committed-but-uncached tokens; returns the roots' draft logits
        ``(B, V')`` float32 on the device (:meth:`gather_rows`)."""
        rids = [s.rid for s in batch]
        chains = []
        for s in batch:
            pending = s.committed_ids[self.runner.cache_len(s.rid) :]
            chains.append(DraftTree.chain(pending[0], pending[1:]))
        logits = self.runner.forward_trees(rids, chains)
        rows = self.gather_rows(
            logits, [(i, chain.num_nodes - 1) for i, chain in enumerate(chains)]
        )
        for s, chain in zip(batch, chains):
            if chain.num_nodes > 1:
                # Keep every committed token but the last: it is the next tree's root.
                self.runner.commit(s.rid, list(range(chain.num_nodes - 1)))
        return rows

    def propose(self, batch) -> list[DraftTree]:
        if not batch:
            return []
        budget = self.num_draft_tokens - 1
        root_rows = self._catch_up(batch)
        if budget == 0:
            return [DraftTree.chain(s.root_token, []) for s in batch]
        values, indices = self.top_log_probs(root_rows, self.topk)
        roots = [[(-1, vs, ts)] for vs, ts in zip(values.tolist(), indices.tolist())]

        def children(logits, index_of, cands, frontiers) -> list[Children]:
            nodes = [(i, index_of[i][f]) for i, front in enumerate(frontiers) for f in front]
            values, indices = self.top_log_probs(self.gather_rows(logits, nodes), self.topk)
            tops = iter(zip(values.tolist(), indices.tolist()))
            return [[(f, *next(tops)) for f in front] for front in frontiers]

        cands = self.expand(batch, roots, children, self.num_steps)
        return [self._select(s.root_token, c, budget) for s, c in zip(batch, cands)]

    def expand(
        self,
        batch: Sequence[Any],
        roots: Sequence[Children],
        children: Callable[..., list[Children]],
        num_steps: int,
    ) -> list[list[Candidate]]:
        """EAGLE-2's expansion loop for a batch (the module docstring), shared by plain and
        grammar-constrained drafting: depth 1 is ``roots`` (per request, the root's top-k, or
        no entry), and each later depth up to ``num_steps`` is one :meth:`forward_spines` over
        the frontiers and ``children(logits, index_of, frontiers)``, the top-k of each frontier
        node worth expanding, merged by :func:`expand_frontier`. ``children`` is called as
        ``children(logits, index_of, cands, frontiers)`` with :meth:`forward_spines`' logits
        and maps, the candidates so far and the frontiers, and returns one :data:`Children`
        per request. Returns each request's :data:`Candidate` list, parents before children."""
        cands: list[list[Candidate]] = [[] for _ in batch]
        frontiers = [expand_frontier(c, root, self.topk) for c, root in zip(cands, roots)]
        rids = [s.rid for s in batch]
        for _ in range(1, num_steps):
            logits, index_of = self.forward_spines(batch, rids, cands, frontiers)
            frontiers = [
                expand_frontier(c, kids, self.topk)
                for c, kids in zip(cands, children(logits, index_of, cands, frontiers))
            ]
        return cands

    def forward_spines(
        self, batch, rids: list[str], cands, frontiers: list[list[int]]
    ) -> tuple[torch.Tensor, list[dict[int, int]]]:
        """One draft forward over each request's frontier nodes and their ancestors; returns
        the logits and, per request, the map candidate index -> tree node."""
        trees, index_of = [], []
        for s, c, front in zip(batch, cands, frontiers):
            keep: set[int] = set()
            for f in front:
                while f != -1 and f not in keep:
                    keep.add(f)
                    f = c[f][1]
            tree, index = tree_from_candidates(
                s.root_token, c, sorted(keep, key=lambda j: (c[j][3], j))
            )
            trees.append(tree)
            index_of.append(index)
        return self.runner.forward_trees(rids, trees), index_of

    @staticmethod
    def _select(root: int, cands, budget: int) -> DraftTree:
        """The ``budget`` best candidates by cumulative log-prob, as a tree under ``root``."""
        return tree_from_candidates(root, cands, best_candidates(cands, budget))[0]
