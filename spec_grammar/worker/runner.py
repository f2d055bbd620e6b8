"""Batched KV cache and tree-attention forwards for a Hugging Face causal LM.

Cache layout: per attention layer, one K and one V buffer of shape
``(rows, kv_heads, capacity, head_dim)`` in the model's dtype. Each live request owns one row;
its committed KV sits at positions ``[0, len)`` of that row (``len`` = committed tokens minus
one: the last committed token is the root of the next draft tree, see
``WORKER_INTERFACES.md``). Live requests occupy rows ``0..n-1`` (removing one moves the last
row into the hole), so a batch of every live request reads the buffers through zero-copy views.

A verify forward over a batch whose longest committed length is ``L`` writes the KV of every
draft-tree node of every request into the scratch region ``[L, L + N_max)`` of its row and
attends with a 4D additive mask ``(B, 1, N_max, L + N_max)``: node ``n`` of request ``b`` sees
the request's ``len_b`` cached positions, its ancestors and itself (SpecInfer's tree attention,
Miao et al. 2024); cache padding ``[len_b, L)`` and other branches are masked. Its position is
``len_b + depth[n]``. :meth:`ModelRunner.commit` then moves the KV of the accepted path to
``[len_b, len_b + k + 1)`` and drops the rest (the scratch region is simply overwritten later);
the moves of all requests' commits are applied together, one gather + scatter per buffer,
before the next forward.

transformers (5.x) hands a ready 4D mask to the attention function unchanged
(``masking_utils._preprocess_mask_arguments``), and its attention layers only call
``cache.update(k, v, layer_idx)``, so the cache below is a small duck-typed object passed as the
model's ``cache`` (``past_key_values`` in older releases) argument; the eager and sdpa
attention paths both add the mask to the scores.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from ..errors import SpecGrammarError
from ..tree import DraftTree

__all__ = ["ModelRunner", "RunnerError"]

# The mask's key length is rounded up to this multiple: CUDA's memory-efficient sdpa kernel
# wants an aligned mask stride and otherwise pads (and warns) on every forward.
_KV_ALIGN = 8


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device`` without blocking the host: on CUDA through page-locked memory
    with ``non_blocking=True`` (a copy from pageable memory synchronizes the stream, which would
    wait for every queued kernel, e.g. the verify forward before the grammar work could start)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class RunnerError(SpecGrammarError, ValueError):
    """Misuse of a :class:`ModelRunner`: unknown or duplicate request id, ``commit`` without a
    pending forward, accepted nodes that are not a root path of the verified tree, bad ids."""


class _KVStore:
    """Per-layer K/V buffers ``(rows, kv_heads, capacity, head_dim)``, allocated lazily at the
    first ``update`` of each layer (so a model running only its first L layers, such as a
    self-draft, allocates L layers). Buffers are created and changed under
    ``torch.inference_mode`` (they are inference tensors)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.rows = 4
        self.capacity = 256

    @torch.inference_mode()
    def reserve(self, rows: int, length: int) -> None:
        """Grow every buffer to at least ``rows`` rows and ``length`` positions (doubling)."""
        new_rows, new_cap = self.rows, self.capacity
        while new_rows < rows:
            new_rows *= 2
        while new_cap < length:
            new_cap *= 2
        if (new_rows, new_cap) == (self.rows, self.capacity):
            return
        for bufs in (self.k, self.v):
            for i, old in bufs.items():
                r, h, c, d = old.shape
                new = old.new_zeros(new_rows, h, new_cap, d)
                new[:r, :, :c] = old
                bufs[i] = new
        self.rows, self.capacity = new_rows, new_cap

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx not in self.k:
            _, h, _, d = like.shape
            # zeros, not empty: masked positions still enter the attention matmul, and
            # 0 * NaN from uninitialised memory would poison every row.
            shape = (self.rows, h, self.capacity, d)
            self.k[idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.v[idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.k[idx], self.v[idx]

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        for bufs in (self.k, self.v):
            for buf in bufs.values():
                buf[dst].copy_(buf[src])

    @torch.inference_mode()
    def move_positions(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For each i, copy position ``src[i]`` of row ``rows[i]`` to position ``dst[i]`` (1-D
        long tensors on the device; destinations distinct). One gather + one scatter per
        buffer, whatever the number of requests."""
        for bufs in (self.k, self.v):
            for buf in bufs.values():
                # the gather copies first, so sources overlapping destinations are safe
                buf[rows, :, dst] = buf[rows, :, src]


class _BatchCache:
    """The ``cache`` object the model sees during one forward: writes the new KV into the
    scratch region ``[start, start + n)`` of the selected rows and returns ``[0, kv_len)``."""

    is_compileable = False

    def __init__(self, store: _KVStore, rows: slice | torch.Tensor, start: int, n: int, kv_len: int):
        self.store, self.rows, self.start, self.n, self.kv_len = store, rows, start, n, kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_buf, v_buf = self.store.layer(layer_idx, key_states)
        end = self.start + self.n
        k_buf[self.rows, :, self.start : end] = key_states
        v_buf[self.rows, :, self.start : end] = value_states
        return k_buf[self.rows, :, : self.kv_len], v_buf[self.rows, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start


class ModelRunner:
    """Batched KV cache + tree-attention forwards for a Hugging Face causal LM.

    Args:
        model: a ``transformers`` causal LM (``LlamaForCausalLM`` and other models whose
            attention layers call ``cache.update``), in eval mode. Its dtype is the compute
            dtype (use ``load_model(..., dtype=torch.float64)`` for tie-proof equality tests).
        device: where the model runs; default: the model's device. The model is moved there.
        prefill_chunk: longest token chunk of one prefill forward (bounds the mask memory).

    Not safe for concurrent calls from several threads; a forward releases the GIL, so grammar
    work in another thread overlaps it.
    """

    def __init__(self, model, *, device: torch.device | str | None = None, prefill_chunk: int = 512):
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        if param.device != self.device:
            model.to(self.device)
        self.model = model
        self.dtype = param.dtype
        head = model.get_output_embeddings()
        self.vocab_size: int = int(getattr(head, "out_features", None) or model.config.vocab_size)
        self.prefill_chunk = int(prefill_chunk)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Sliding-window attention (Gemma-3, Mistral): the window is part of our 4D mask, since
        # transformers uses a ready 4D mask as-is.
        config = model.config
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        self._per_layer_type = bool(layer_types)
        self._window: int | None = (
            int(window) if window and (not layer_types or "sliding_attention" in layer_types) else None
        )
        self._store = _KVStore(self.device)
        self._rids: list[str] = []  # row -> request id
        self._row: dict[str, int] = {}
        self._len: list[int] = []  # row -> committed KV length
        self._pending: dict[str, tuple[int, DraftTree]] = {}  # rid -> (scratch start, tree)
        self._moves: list[tuple[int, int, int]] = []  # committed KV to move: (row, src, dst)

    # -- requests ---------------------------------------------------------------------------
    @property
    def request_ids(self) -> list[str]:
        """Ids of the live requests."""
        return list(self._rids)

    def add(self, rid: str, prompt_ids: Sequence[int]) -> None:
        """Start request ``rid``: prefill the KV of ``prompt_ids[:-1]`` (the last prompt token is
        the root of the first draft tree). Raises :class:`RunnerError` on a duplicate id, an
        empty prompt or ids outside ``[0, vocab_size)``."""
        if rid in self._row:
            raise RunnerError(f"request {rid!r} is already in the runner")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise RunnerError(f"request {rid!r}: the prompt is empty")
        self._check_ids(ids)  # the last id is fed later as a tree root: check it here too
        row = len(self._rids)
        self._store.reserve(row + 1, 0)
        self._rids.append(rid)
        self._row[rid] = row
        self._len.append(0)
        try:
            self.extend(rid, ids[:-1])
        except Exception:
            self.remove(rid)
            raise

    def remove(self, rid: str) -> None:
        """Drop request ``rid`` and its KV. Raises :class:`RunnerError` for an unknown id."""
        row = self._row_of(rid)
        self._flush_moves()
        last = len(self._rids) - 1
        if row != last:
            self._store.move_row(last, row)
            moved = self._rids[last]
            self._rids[row], self._len[row] = moved, self._len[last]
            self._row[moved] = row
        self._rids.pop()
        self._len.pop()
        del self._row[rid]
        self._pending.pop(rid, None)

    def cache_len(self, rid: str) -> int:
        """Number of positions in ``rid``'s KV cache (committed tokens minus one)."""
        return self._len[self._row_of(rid)]

    def extend(self, rid: str, token_ids: Sequence[int]) -> None:
        """Append the KV of committed ``token_ids`` to ``rid``'s cache (chunked prefill; a draft
        runner uses it to catch up with tokens the target committed). Drops a pending tree."""
        ids = [int(t) for t in token_ids]
        self._check_ids(ids)
        row = self._row_of(rid)
        self._pending.pop(rid, None)
        for s in range(0, len(ids), self.prefill_chunk):
            chunk = torch.tensor(ids[s : s + self.prefill_chunk], dtype=torch.long)
            c = chunk.numel()
            # a single row's scratch starts at its own length: the chain's KV lands in place
            self._forward(
                [row],
                chunk[None],
                torch.arange(c)[None],
                torch.ones(c, c, dtype=torch.bool).tril_()[None],
                logits_to_keep=1,
            )
            self._len[row] += c

    # -- verify -----------------------------------------------------------------------------
    def forward_trees(self, rids: Sequence[str], trees: Sequence[DraftTree]) -> torch.Tensor:
        """One forward over every node of every request's draft tree.

        Args:
            rids: live request ids (any order, no duplicates).
            trees: one :class:`DraftTree` per request; node 0 is the request's last committed
                token. Tokens outside ``[0, vocab_size)`` (invalid drafts, padding) are run as
                token 0: their rows are garbage and verification never accepts them.

        Returns:
            ``(len(rids), N_max, vocab_size)`` float32 logits on the runner's device; row ``n``
            of request ``i`` is the distribution of the token after the path root..n. Rows at
            or past ``trees[i].num_nodes`` are garbage.

        Cache lengths do not change: the tree KV waits in scratch until :meth:`commit` (a later
        forward that includes the same request replaces it). Raises :class:`RunnerError` on
        unknown or duplicate ids or mismatched lengths.
        """
        if len(rids) != len(trees):
            raise RunnerError(f"{len(rids)} request ids but {len(trees)} trees")
        if len(set(rids)) != len(rids):
            raise RunnerError("duplicate request ids in one forward")
        if not rids:
            return torch.empty(0, 0, self.vocab_size, device=self.device)
        rows = [self._row_of(r) for r in rids]
        order = sorted(range(len(rids)), key=rows.__getitem__)
        n_max = max(t.num_nodes for t in trees)
        b = len(rids)
        tokens = torch.zeros(b, n_max, dtype=torch.long)
        depth = torch.zeros(b, n_max, dtype=torch.long)
        anc = torch.eye(n_max, dtype=torch.bool).repeat(b, 1, 1)  # padded nodes see themselves
        for j, i in enumerate(order):
            t = trees[i]
            n = t.num_nodes
            tok = t.tokens
            tokens[j, :n] = torch.where((tok >= 0) & (tok < self.vocab_size), tok, 0)
            depth[j, :n] = t.depth
            anc[j, :n, :n] = t.ancestor_mask
        logits, start = self._forward([rows[i] for i in order], tokens, depth, anc, logits_to_keep=0)
        for i in order:
            self._pending[rids[i]] = (start, trees[i])
        inverse = torch.empty(b, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(b)
        return logits[_upload(inverse, self.device)] if order != list(range(b)) else logits

    def commit(self, rid: str, accepted_nodes: Sequence[int]) -> None:
        """Keep the KV of ``accepted_nodes`` (root first: ``[0, a1, .., ak]``, each the parent of
        the next, in the tree of the last :meth:`forward_trees` that included ``rid``); the
        cache grows by ``k + 1``. Raises :class:`RunnerError` without a pending forward or when
        the nodes are not a root path."""
        row = self._row_of(rid)
        if rid not in self._pending:
            raise RunnerError(f"request {rid!r} has no verified tree to commit")
        start, tree = self._pending[rid]
        nodes = [int(n) for n in accepted_nodes]
        if not nodes or nodes[0] != 0:
            raise RunnerError(f"accepted nodes must start at the root (0), got {nodes}")
        for parent, child in zip(nodes, nodes[1:]):
            if not 0 < child < tree.num_nodes or tree.parent_list[child] != parent:
                raise RunnerError(f"accepted nodes {nodes} are not a root path of {tree}")
        del self._pending[rid]
        length = self._len[row]
        if start != length or nodes != list(range(len(nodes))):
            # batched with the other commits of this step at the next forward/remove
            self._moves.extend((row, start + node, length + i) for i, node in enumerate(nodes))
        self._len[row] = length + len(nodes)

    def _flush_moves(self) -> None:
        """Apply the KV moves of every commit since the last forward, all requests at once."""
        if self._moves:
            moves = _upload(torch.tensor(self._moves, dtype=torch.long), self.device)
            self._store.move_positions(moves[:, 0], moves[:, 1], moves[:, 2])
            self._moves.clear()

    # -- internals --------------------------------------------------------------------------
    def _row_of(self, rid: str) -> int:
        try:
            return self._row[rid]
        except KeyError:
            raise RunnerError(f"unknown request id {rid!r}") from None

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RunnerError(f"token ids {bad[:8]} are outside [0, {self.vocab_size})")

    def _forward(
        self,
        rows: list[int],
        tokens: torch.Tensor,
        depth: torch.Tensor,
        anc: torch.Tensor,
        *,
        logits_to_keep: int,
    ) -> tuple[torch.Tensor, int]:
        """Run ``tokens (b, n)`` for ascending ``rows`` with tree mask ``anc (b, n, n)`` and
        ``depth (b, n)`` (CPU tensors); returns (float32 logits, scratch start)."""
        self._flush_moves()
        b, n = tokens.shape
        lens = torch.tensor([self._len[r] for r in rows], dtype=torch.long)
        start = int(lens.max())
        kv_len = -(-(start + n) // _KV_ALIGN) * _KV_ALIGN
        self._store.reserve(len(self._rids), kv_len)
        if rows == list(range(rows[0], rows[0] + b)):
            sel: slice | torch.Tensor = slice(rows[0], rows[0] + b)
        else:
            sel = _upload(torch.tensor(rows, dtype=torch.long), self.device)

        dev = self.device
        lens_d = _upload(lens, dev)
        positions = lens_d[:, None] + _upload(depth, dev)
        allowed = torch.zeros(b, n, kv_len, dtype=torch.bool, device=dev)
        allowed[:, :, :start] = (torch.arange(start, device=dev)[None] < lens_d[:, None])[:, None, :]
        allowed[:, :, start : start + n] = _upload(anc, dev)
        mask = self._additive(allowed)
        if self._window is not None:
            key_pos = torch.zeros(b, kv_len, dtype=torch.long, device=dev)
            key_pos[:, :start] = torch.arange(start, device=dev)
            key_pos[:, start : start + n] = positions
            in_window = positions[:, :, None] - key_pos[:, None, :] < self._window
            window_mask = self._additive(allowed & in_window)
            # layer_types models take one mask per layer type; others use the window everywhere
            mask = (
                {"full_attention": mask, "sliding_attention": window_mask}
                if self._per_layer_type
                else window_mask
            )

        cache = _BatchCache(self._store, sel, start, n, kv_len)
        with torch.inference_mode():
            out = self.model(
                input_ids=_upload(tokens, dev),
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kw: cache},
            )
        return out.logits.float(), start

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """``(b, n, kv)`` bool -> ``(b, 1, n, kv)`` additive mask in the model dtype."""
        mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype).min)
