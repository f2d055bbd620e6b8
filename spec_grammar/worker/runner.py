"""Batched KV cache and tree-attention forwards for a Hugging Face causal LM.

Cache layout: per attention layer, one K and one V buffer of shape
``(rows, kv_heads, capacity, head_dim)`` in the model's dtype. Each live request owns one row;
its committed KV sits at positions ``[0, len)`` of that row (``len`` = committed tokens minus
one: the last committed token is the root of the next draft tree, see
``WORKER_INTERFACES.md``). Live requests occupy rows ``0..n-1`` (removing one moves the last
row into the hole), so a batch of every live request reads the buffers through zero-copy views.

A verify forward writes the KV of every draft-tree node of request ``b`` into the scratch
region ``[len_b, len_b + N)`` of its row (just past its committed KV) and attends with a 4D
additive mask ``(B, 1, N, kv_len)``: node ``n`` sees the request's ``len_b`` cached positions,
its ancestors and itself (SpecInfer's tree attention, Miao et al. 2024); everything else is
masked. Its position is ``len_b + depth[n]``. :meth:`ModelRunner.commit` then moves the KV of
the accepted path to ``[len_b, len_b + k + 1)`` (nothing moves when the accepted nodes are the
first ``k + 1`` nodes, as for a chain) and drops the rest; the moves of all requests' commits
are applied together, one gather + scatter per buffer, before the next forward. The mask,
positions and write positions are computed on the device from ``len (B,)`` and the parents
``(B, N)`` (ancestor masks and depths by pointer doubling, :func:`ancestors`), so the whole
forward is capturable as a CUDA graph
(:mod:`.cuda_graphs`): on CUDA, a forward over every live request replays the graph of its
shape bucket; other forwards (prefill chunks, subsets of the requests) run eagerly.

transformers (5.x) hands a ready 4D mask to the attention function unchanged
(``masking_utils._preprocess_mask_arguments``), and its attention layers only call
``cache.update(k, v, layer_idx)``, so the cache below is a small duck-typed object passed as the
model's ``cache`` (``past_key_values`` in older releases) argument; the eager and sdpa
attention paths both add the mask to the scores.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import SpecGrammarError
from ..kernels import row_argmax
from ..tree import DraftTree
from .cuda_graphs import ForwardGraphs, bucket
from .decoder import FusedLlama, unsupported_reason
from .decoder.ops import triton_ops

__all__ = ["ModelRunner", "RunnerError", "check_optional_flag"]

# The attention's key length is a power of two of at least this (an aligned mask stride for
# CUDA's memory-efficient sdpa kernel, and few CUDA-graph buckets); eager forwards use the same
# lengths as graphs, so both paths compute the same attention.
_MIN_KV = 64
# Largest batch / tree bucket captured as a CUDA graph; larger forwards run eagerly.
_MAX_GRAPH_BATCH = 64
_MAX_GRAPH_NODES = 64


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device`` without blocking the host: on CUDA through page-locked memory
    with ``non_blocking=True`` (a copy from pageable memory synchronizes the stream, which would
    wait for every queued kernel, e.g. the verify forward before the grammar work could start)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self masks and depths of a batch of trees, on the parents' device.

    Args:
        parents: ``(b, n)`` long, each node's parent index or -1 for a root (padding nodes are
            roots of their own).

    Returns ``anc (b, n, n)`` bool (``[k, i, j]``: ``j`` is ``i`` or an ancestor of ``i``) and
    ``depth (b, n)`` long (ancestors excluding self).

    Pointer doubling (Wyllie's list ranking, 1979): after step ``s`` each row holds the
    ancestors closer than ``2**s`` and ``jump`` the ``2**s``-th ancestor (a root points to
    itself), so ``ceil(log2 n)`` steps of batched gathers cover any tree, with no host work and
    no host synchronization (the runner captures it in its CUDA graphs). Building the masks on
    the host instead cost ~10 us per tree per step: 0.4-1 ms at 32 requests.
    """
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    jump = torch.where(parents >= 0, parents, idx[None, :])
    anc = (idx[:, None] == idx[None, :]).expand(b, n, n)
    for _ in range((n - 1).bit_length()):
        anc = anc | anc.gather(1, jump[:, :, None].expand(b, n, n))
        jump = jump.gather(1, jump)
    return anc, anc.sum(-1) - 1


class RunnerError(SpecGrammarError, ValueError):
    """Misuse of a :class:`ModelRunner`: unknown or duplicate request id, ``commit`` without a
    pending forward, accepted nodes that are not a root path of the verified tree, bad ids."""


def check_optional_flag(name: str, value: Any) -> bool | None:
    """``value`` when it is None, True or False; else :class:`RunnerError` naming ``name`` (a
    runner flag such as ``cuda_graphs``: "off" or 0 must not pass for a setting)."""
    if value is not None and not isinstance(value, bool):
        raise RunnerError(f"{name} must be None, True or False, got {value!r}")
    return value


_GRAPH_STORE_API = ("run", "clear", "captures", "last_events")


def _check_graph_store(graphs: Any) -> None:
    """Raises :class:`RunnerError` unless ``graphs`` is None or has a graph store's API (a
    bool or a string must not pass for one: the switch is ``cuda_graphs``)."""
    if graphs is None:
        return
    missing = [name for name in _GRAPH_STORE_API if not hasattr(graphs, name)]
    if isinstance(graphs, (bool, str)) or missing or not callable(graphs.run):
        raise RunnerError(
            "graphs must be None, a ForwardGraphs or an object with its "
            f"{' / '.join(_GRAPH_STORE_API)}, got {graphs!r}"
            + (
                " (to switch CUDA graphs on or off, use cuda_graphs=)"
                if isinstance(graphs, bool)
                else ""
            )
        )


def _token_ids(ids: Sequence[int], what: str) -> list[int]:
    """``ids`` as a list of Python ints. Raises :class:`RunnerError` (naming ``what``) for text
    or a non-iterable, and for an id that is not an integer (``int()`` would truncate 1.5,
    read ``"7"`` as 7 and a bool as 0 / 1)."""
    if isinstance(ids, (str, bytes)):
        raise RunnerError(f"{what}: token ids must be a sequence of ints, got {type(ids).__name__}")
    try:
        items = list(ids)
    except TypeError:
        raise RunnerError(
            f"{what}: token ids must be a sequence of ints, got {type(ids).__name__}"
        ) from None
    out = []
    for t in items:
        try:
            if isinstance(t, (bool, np.bool_)):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise RunnerError(f"{what}: token id {t!r} is not an int") from None
    return out


class _KVStore:
    """The KV buffers of every attention layer, stacked in one tensor
    ``(layers, 2, rows, kv_heads, capacity, head_dim)`` (K at ``[i, 0]``, V at ``[i, 1]``), so
    that moving committed positions, moving a row or growing the cache is one operation for all
    layers (per-layer buffers cost two index kernels per layer per step: ~2-4 ms of host time
    per step for a 32-layer model, more than a CUDA-graph forward's launch).

    Allocated at the first ``layer`` call, with that layer's heads, head size and dtype, for
    ``num_layers`` layers (a self-draft's truncated model has fewer); a layer of another shape
    or past ``num_layers`` gets a stack of its own (one layer, same layout). Buffers are
    created and changed under ``torch.inference_mode`` (they are inference tensors)."""

    def __init__(self, device: torch.device, num_layers: int):
        self.device = device
        self.num_layers = max(1, int(num_layers))
        self.stack: torch.Tensor | None = None
        self.extra: dict[int, torch.Tensor] = {}  # layer -> (1, 2, rows, heads, capacity, dim)
        self.rows = 4
        self.capacity = 256
        self.version = 0  # bumped when the buffers are reallocated (CUDA graphs address them)

    def _buffers(self) -> list[torch.Tensor]:
        return ([self.stack] if self.stack is not None else []) + list(self.extra.values())

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

        def grown(old: torch.Tensor) -> torch.Tensor:
            layers, _, r, h, c, d = old.shape
            new = old.new_zeros(layers, 2, new_rows, h, new_cap, d)
            new[:, :, :r, :, :c] = old
            return new

        if self.stack is not None:
            self.stack = grown(self.stack)
        self.extra = {i: grown(buf) for i, buf in self.extra.items()}
        self.rows, self.capacity = new_rows, new_cap
        self.version += 1

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers ``(rows, kv_heads, capacity, head_dim)`` of layer ``idx``; ``like``
        ``(_, kv_heads, _, head_dim)`` gives their shape and dtype when they are created."""
        _, h, _, d = like.shape
        stack = self.stack
        if (
            stack is not None
            and idx < self.num_layers
            and stack.shape[3] == h
            and stack.shape[5] == d
        ):
            return stack[idx, 0], stack[idx, 1]
        if idx not in self.extra:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                # a buffer allocated inside a capture would live in the graph's private pool
                raise RuntimeError(f"KV layer {idx} first seen during a CUDA graph capture")
            to_stack = stack is None and idx < self.num_layers
            with torch.inference_mode():
                # zeros, not empty: masked positions still enter the attention matmul, and
                # 0 * NaN from uninitialised memory would poison every row.
                buf = torch.zeros(
                    (self.num_layers if to_stack else 1, 2, self.rows, h, self.capacity, d),
                    dtype=like.dtype,
                    device=like.device,
                )
            if to_stack:
                self.stack = buf
                return buf[idx, 0], buf[idx, 1]
            self.extra[idx] = buf
        return self.extra[idx][0, 0], self.extra[idx][0, 1]

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        for buf in self._buffers():
            buf[:, :, dst].copy_(buf[:, :, src])

    @torch.inference_mode()
    def move_positions(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For each i, copy position ``src[i]`` of row ``rows[i]`` to position ``dst[i]`` (1-D
        long tensors on the device; destinations distinct). One gather + one scatter for all
        layers, whatever the number of requests."""
        for buf in self._buffers():
            # the gather copies first, so sources overlapping destinations are safe
            buf[:, :, rows, :, dst] = buf[:, :, rows, :, src]


class _BatchCache:
    """The ``cache`` object the model sees during one forward: writes the new KV of batch item
    ``i`` at positions ``write_pos[i]`` of row ``row_idx[i]`` and returns positions
    ``[0, kv_len)`` of the selected rows."""

    is_compileable = False

    def __init__(
        self,
        store: _KVStore,
        rows: slice | torch.Tensor,
        row_idx: torch.Tensor,
        write_pos: torch.Tensor,
        kv_len: int,
    ):
        self.store, self.rows, self.kv_len = store, rows, kv_len
        self.row_idx, self.write_pos = row_idx[:, None], write_pos

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_buf, v_buf = self.store.layer(layer_idx, key_states)
        # (b, heads, n, dim) -> (b, n, heads, dim): the advanced indices (row, position) lead
        k_buf[self.row_idx, :, self.write_pos] = key_states.transpose(1, 2)
        v_buf[self.row_idx, :, self.write_pos] = value_states.transpose(1, 2)
        return k_buf[self.rows, :, : self.kv_len], v_buf[self.rows, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids; the mask is a ready 4D mask


class ModelRunner:
    """Batched KV cache + tree-attention forwards for a Hugging Face causal LM.

    Args:
        model: a ``transformers`` causal LM (``LlamaForCausalLM`` and other models whose
            attention layers call ``cache.update``), in eval mode. Its dtype is the compute
            dtype (use ``load_model(..., dtype=torch.float64)`` for tie-proof equality tests).
        device: where the model runs; default: the model's device. The model is moved there.
        prefill_chunk: longest token chunk of one request in a prefill forward (bounds the mask
            memory).
        prefill_tokens: most tokens (requests x chunk) of one prefill forward of several
            requests (:meth:`add_batch`); at least ``prefill_chunk`` (else :class:`RunnerError`).
        cuda_graphs: replay CUDA graphs for forwards over every live request (batch <= 64,
            trees <= 64 nodes; :mod:`.cuda_graphs`). None (default): on for CUDA devices.
            Ignored off CUDA. Graph outputs are valid until the next forward of this runner.
        fused_forward: run the model through our fused decoder (:mod:`.decoder`: merged
            projections, one kernel per norm / rotary + KV write / SiLU; Llama, Mistral without
            sliding window, Qwen2) instead of its HF forward. None (default): on when the
            model is supported, on CPU and on CUDA devices with Triton, else off. True:
            required (raises :class:`RunnerError` naming why a model is unsupported). Off CUDA it
            runs the same operations in torch (they match the HF forward) with oneDNN
            projections, and eager forwards skip the padding rows of ragged trees.
        graphs: the graph store full-batch forwards replay through, instead of the one
            ``cuda_graphs`` asks for: a :class:`~.cuda_graphs.ForwardGraphs` or an object with
            its ``run`` / ``clear`` / ``captures`` / ``last_events`` (the tests emulate replays
            on CPU with one, ``tests/emulated_graphs.py``). None (default): as ``cuda_graphs``
            says.

    Not safe for concurrent calls from several threads; a forward releases the GIL, so grammar
    work in another thread overlaps it.
    """

    def __init__(
        self,
        model,
        *,
        device: torch.device | str | None = None,
        prefill_chunk: int = 512,
        prefill_tokens: int = 8192,
        cuda_graphs: bool | None = None,
        fused_forward: bool | None = None,
        graphs: ForwardGraphs | None = None,
    ):
        param = next(model.parameters(), None)
        if param is None:
            raise RunnerError("the model has no parameters")
        # one KV store and one graph per forward: the whole model must sit on one device
        devices = {t.device for t in model.parameters()}
        if any(
            t.device.type == "meta" for t in itertools.chain(model.parameters(), model.buffers())
        ):
            raise RunnerError(
                "some model weights are on the meta device (offloaded or not loaded, e.g. by "
                "device_map='auto'); load the whole model on one device"
            )
        if device is None and len(devices) > 1:
            raise RunnerError(
                f"the model is split over {', '.join(sorted(map(str, devices)))} (e.g. by device_map); "
                "load it on one device or pass device= to move it there"
            )
        self.device = torch.device(device) if device is not None else param.device
        if devices != {self.device}:
            model.to(self.device)
        self.model = model
        self.dtype = param.dtype
        head = model.get_output_embeddings()
        self.vocab_size: int = int(getattr(head, "out_features", None) or model.config.vocab_size)
        for name, value in (("prefill_chunk", prefill_chunk), ("prefill_tokens", prefill_tokens)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise RunnerError(f"{name} must be an int, got {value!r}")
        if int(prefill_chunk) < 1 or int(prefill_tokens) < int(prefill_chunk):
            raise RunnerError(
                f"need 1 <= prefill_chunk <= prefill_tokens, got {prefill_chunk}, {prefill_tokens}"
            )
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_tokens = int(prefill_tokens)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Sliding-window attention (Gemma-3, Mistral): the window is part of our 4D mask, since
        # transformers uses a ready 4D mask as-is.
        config = model.config
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        self._per_layer_type = bool(layer_types)
        self._window: int | None = (
            int(window)
            if window and (not layer_types or "sliding_attention" in layer_types)
            else None
        )
        check_optional_flag("cuda_graphs", cuda_graphs)
        check_optional_flag("fused_forward", fused_forward)
        reason = unsupported_reason(model) or (
            "sliding-window attention" if self._window is not None else None
        )
        if fused_forward and reason is not None:
            raise RunnerError(
                f"fused_forward=True, but the fused decoder cannot run this model: {reason}"
            )
        if fused_forward is None:
            fused_forward = reason is None and (
                self.device.type == "cpu" or (self.device.type == "cuda" and triton_ops is not None)
            )
        self._fused = FusedLlama(model) if fused_forward else None
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._store = _KVStore(self.device, getattr(text_config, "num_hidden_layers", 1))
        _check_graph_store(graphs)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if graphs is None and use_graphs and self.device.type == "cuda":
            graphs = ForwardGraphs(self.device)
        self._graphs = graphs
        self._graphs_version = self._store.version
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

    @property
    def uses_cuda_graphs(self) -> bool:
        """True when full-batch forwards replay CUDA graphs: :meth:`forward_trees` then returns
        as soon as the graph is launched, and the host is free while the GPU computes."""
        return self._graphs is not None

    def last_forward_gpu_ms(self) -> float | None:
        """GPU milliseconds of the last :meth:`forward_trees` when it replayed a CUDA graph and
        the GPU has finished it (None otherwise); never waits."""
        events = self._graphs.last_events if self._graphs is not None else None
        if events is None or not events[1].query():
            return None
        return events[0].elapsed_time(events[1])

    @property
    def uses_fused_forward(self) -> bool:
        """True when forwards run our fused decoder (:mod:`.decoder`) instead of the HF forward."""
        return self._fused is not None

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (0 without graphs)."""
        return self._graphs.captures if self._graphs is not None else 0

    def clear_graphs(self) -> None:
        """Free every captured CUDA graph (they are captured again when needed)."""
        if self._graphs is not None:
            self._graphs.clear()

    def add(self, rid: str, prompt_ids: Sequence[int]) -> None:
        """Start request ``rid``: prefill the KV of ``prompt_ids[:-1]`` (the last prompt token is
        the root of the first draft tree). Raises :class:`RunnerError` on a duplicate id, an
        empty prompt, ids that are not ints or ids outside ``[0, vocab_size)``."""
        refused = self.add_batch([(rid, prompt_ids)])
        if refused:
            raise refused[rid]

    def add_batch(self, requests: Sequence[tuple[str, Sequence[int]]]) -> dict[str, RunnerError]:
        """Start several requests ``(rid, prompt_ids)`` as :meth:`add` does, prefilling them
        together: each forward takes one chunk (at most ``prefill_chunk`` tokens) of up to
        ``prefill_tokens // prefill_chunk`` requests, shorter chunks padded. A forward costs the
        launches of the whole model whatever its size (an eager SmolLM2-135M forward: 10-15 ms of
        launches on the H200 host), so 32 prompts prefilled one by one cost 32 of them.

        Returns the requests refused (duplicate id, empty prompt, ids that are not ints or lie
        outside ``[0, vocab_size)``) by id, with the reason; the others are started. A forward
        (or a malformed entry) that raises leaves none of this call's requests in the runner and
        propagates."""
        refused: dict[str, RunnerError] = {}
        started: list[tuple[int, list[int]]] = []  # (row, ids to prefill)
        try:  # whatever raises (a malformed entry, a forward), none of this call's requests stay
            for rid, prompt_ids in requests:
                try:
                    if rid in self._row:
                        raise RunnerError(f"request {rid!r} is already in the runner")
                    ids = _token_ids(prompt_ids, f"request {rid!r}")
                    if not ids:
                        raise RunnerError(f"request {rid!r}: the prompt is empty")
                    self._check_ids(
                        ids
                    )  # the last id is fed later as a tree root: check it here too
                except RunnerError as e:
                    refused[rid] = e
                    continue
                row = len(self._rids)
                self._rids.append(rid)
                self._row[rid] = row
                self._len.append(0)
                started.append((row, ids[:-1]))
            if not started:
                return refused
            self._store.reserve(len(self._rids), 0)
            self._prefill(started)
        except BaseException:
            for row, _ in reversed(started):  # the last rows first: no row moves
                self.remove(self._rids[row])
            raise
        return refused

    def _prefill(self, chains: list[tuple[int, list[int]]]) -> None:
        """Append the KV of each ``(row, ids)`` chain to its row, several rows per forward."""
        per_forward = max(1, self.prefill_tokens // self.prefill_chunk)
        done = {row: 0 for row, _ in chains}
        while True:
            # similar lengths share a forward (less padding); a forward takes its rows ascending
            todo = [(row, ids) for row, ids in chains if done[row] < len(ids)]
            todo.sort(key=lambda c: len(c[1]) - done[c[0]])
            if not todo:
                return
            for g in range(0, len(todo), per_forward):
                group = sorted(todo[g : g + per_forward])
                parts = [ids[done[row] : done[row] + self.prefill_chunk] for row, ids in group]
                c = max(map(len, parts))
                # padded nodes: token 0, roots of their own; their KV lands past the row's
                # length, where the next write to that row goes anyway
                tokens = torch.zeros(len(group), c, dtype=torch.long)
                parents = torch.full((len(group), c), -1, dtype=torch.long)
                for j, part in enumerate(parts):
                    tokens[j, : len(part)] = torch.tensor(part, dtype=torch.long)
                    parents[j, : len(part)] = torch.arange(-1, len(part) - 1)
                rows = [row for row, _ in group]
                committed = [self._len[row] for row in rows]
                self._forward(
                    rows,
                    dict(tokens=tokens, parents=parents, lens=torch.tensor(committed)),
                    logits_to_keep=1,
                    graph=False,
                    chains=list(zip(committed, map(len, parts))),
                )
                for row, part in zip(rows, parts):
                    self._len[row] += len(part)
                    done[row] += len(part)

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
        ids = _token_ids(token_ids, f"request {rid!r}")
        self._check_ids(ids)
        row = self._row_of(rid)
        self._pending.pop(rid, None)
        self._prefill([(row, ids)])

    # -- verify -----------------------------------------------------------------------------
    def forward_trees(
        self,
        rids: Sequence[str],
        trees: Sequence[DraftTree],
        *,
        before_launch: Callable[[], None] | None = None,
        with_argmax: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward over every node of every request's draft tree.

        Args:
            rids: live request ids (any order, no duplicates).
            trees: one :class:`DraftTree` per request; node 0 is the request's last committed
                token. Tokens outside ``[0, vocab_size)`` (invalid drafts, padding) are run as
                token 0: their rows are garbage and verification never accepts them.
            before_launch: called once, right before a CUDA-graph replay, when the inputs are
                prepared: the replay releases the GIL for its whole host-side launch (~1 us per
                kernel node: 0.3-0.5 ms for a 30-layer model), so a thread started here (the
                worker's grammar work) runs meanwhile. Not called when no graph replays.
            with_argmax: also return each row's :func:`~spec_grammar.kernels.row_argmax`
                (greedy verification reads it instead of launching its own argmax). A CUDA graph
                computes it in the replay (no launch); an eager forward launches it after.

        Returns:
            ``(len(rids), N_max, vocab_size)`` float32 logits on the runner's device; row ``n``
            of request ``i`` is the distribution of the token after the path root..n. Rows at
            or past ``trees[i].num_nodes`` are garbage. With ``with_argmax``, the tuple
            ``(logits, row_argmax)`` with ``row_argmax`` ``(len(rids), N_max)`` int64 on the
            same device.

        Cache lengths do not change: the tree KV waits in scratch until :meth:`commit` (a later
        forward that includes the same request replaces it). Raises :class:`RunnerError` on
        unknown or duplicate ids or mismatched lengths.
        """
        if len(rids) != len(trees):
            raise RunnerError(f"{len(rids)} request ids but {len(trees)} trees")
        if len(set(rids)) != len(rids):
            raise RunnerError("duplicate request ids in one forward")
        if not rids:
            empty = torch.empty(0, 0, self.vocab_size, device=self.device)
            return (
                (empty, torch.empty(0, 0, dtype=torch.long, device=self.device))
                if with_argmax
                else empty
            )
        rows = [self._row_of(r) for r in rids]
        order = sorted(range(len(rids)), key=rows.__getitem__)
        n_max = max(t.num_nodes for t in trees)
        b = len(rids)
        # a forward over every live request (rows 0..b-1) may replay a CUDA graph: build its
        # inputs at the graph bucket's shape right away (idle rows and nodes padded)
        graph = (
            self._graphs is not None
            and b == len(self._rids)
            and b <= _MAX_GRAPH_BATCH
            and n_max <= _MAX_GRAPH_NODES
        )
        bb, nb = (bucket(b), bucket(n_max)) if graph else (b, n_max)
        # only tokens and parents go up: the ancestor masks and depths are built on the device
        tokens = np.zeros((bb, nb), dtype=np.int64)
        parents = np.full((bb, nb), -1, dtype=np.int64)  # padded nodes: roots of their own
        for j, i in enumerate(order):
            t = trees[i]
            tokens[j, : t.num_nodes] = t.token_list
            parents[j, : t.num_nodes] = t.parent_list
        tokens[(tokens < 0) | (tokens >= self.vocab_size)] = 0
        lens = np.zeros(bb, dtype=np.int64)
        lens[:b] = [self._len[rows[i]] for i in order]
        inputs = dict(
            tokens=torch.from_numpy(tokens),
            parents=torch.from_numpy(parents),
            lens=torch.from_numpy(lens),
        )
        sorted_rows = [rows[i] for i in order]
        logits, top = self._forward(
            sorted_rows, inputs, logits_to_keep=0, graph=graph, before_launch=before_launch
        )
        logits = logits[:b, :n_max]
        if with_argmax:
            top = row_argmax(logits) if top is None else top[:b, :n_max]
        for i in order:
            self._pending[rids[i]] = (self._len[rows[i]], trees[i])
        if order != list(range(b)):
            inverse = torch.empty(b, dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(b)
            inverse = _upload(inverse, self.device)
            logits = logits[inverse]
            top = top[inverse] if with_argmax else None
        return (logits, top) if with_argmax else logits

    def forward_shape(self, node_counts: Sequence[int]) -> tuple[int, int]:
        """``(rows, padded)`` of a :meth:`forward_trees` over trees of ``node_counts`` nodes:
        the rows its projections, norms and LM head compute, and the query rows its attention
        runs on. Where the fused forward skips padding (CPU): the real nodes, and for attention
        the real nodes too where the CPU attention kernel runs
        (:meth:`~.decoder.FusedLlama.attends_unpadded`), else the batch padded to its largest
        tree (``len * max``). A forward over every live request that
        replays a CUDA graph: the graph's bucket shape for both; else the padded batch for
        both."""
        b, n_max = len(node_counts), max(node_counts, default=0)
        if self._fused is not None and self.device.type == "cpu":
            rows = int(sum(node_counts))
            return rows, rows if self._fused.attends_unpadded(n_max) else b * n_max
        if (
            self._graphs is not None
            and b == len(self._rids)
            and b <= _MAX_GRAPH_BATCH
            and n_max <= _MAX_GRAPH_NODES
        ):
            shape = bucket(b) * bucket(n_max)
            return shape, shape
        return b * n_max, b * n_max

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
        inputs: dict[str, torch.Tensor],
        *,
        logits_to_keep: int,
        graph: bool,
        before_launch: Callable[[], None] | None = None,
        chains: list[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a batch for ascending ``rows``. ``inputs`` (CPU tensors): ``tokens``, ``parents``
        ``(B, N)`` long (-1 for roots), ``lens (B,)`` long.
        With ``graph``, ``rows`` are every live row (0..b-1) and ``inputs`` are padded to the
        graph bucket ``B = bucket(b)``, ``N = bucket(n)`` (idle rows: length 0, past the live
        rows, so their writes touch no live KV; padded nodes: token 0, parent -1, so they
        attend to themselves); otherwise ``B = len(rows)``. Returns ``(B, N or logits_to_keep, V)``
        float32 logits and, from a graph replay, their ``(B, N)`` :func:`row_argmax` (computed in
        the graph, a few microseconds of GPU time), else None. ``before_launch``: as in
        :meth:`forward_trees`. ``chains``: each row's ``(committed, length)`` where its nodes
        are a chain (a prefill chunk): on CPU the fused decoder then attends per request without
        padding (:meth:`FusedLlama.forward`); elsewhere the padded layout costs about the same."""
        self._flush_moves()
        if self._graphs is not None:
            self._graphs.last_events = None
        bb, nb = inputs["tokens"].shape
        kv_len = int(inputs["lens"].max()) + nb
        if graph or self.device.type != "cpu":
            # few distinct shapes (CUDA graphs are captured per bucket; eager CUDA kernels are
            # tuned per shape); on CPU attention costs what its keys cost, so no padding
            kv_len = bucket(kv_len, _MIN_KV)
        if graph:
            self._store.reserve(bb, kv_len)
            if self._store.version != self._graphs_version:
                self._graphs.clear()
                self._graphs_version = self._store.version

            def forward(tokens, parents, lens):
                # every tensor a graph reads must outlive it: made inside the capture, the row
                # indices live in the graph's pool (a tensor from outside would be freed and its
                # memory reused while the graph still reads it)
                row_idx = torch.arange(bb, device=tokens.device)
                logits = self._device_forward(
                    tokens,
                    parents,
                    lens,
                    row_idx,
                    rows=slice(0, bb),
                    kv_len=kv_len,
                    logits_to_keep=0,
                )
                return logits, row_argmax(logits)

            out = self._graphs.run((bb, nb, kv_len), inputs, forward, before_launch=before_launch)
            if out is not None:
                return out
            b = len(rows)  # this bucket cannot be captured: run the live rows eagerly
            inputs = {k: v[:b] for k, v in inputs.items()}
        b = len(rows)
        self._store.reserve(len(self._rids), kv_len)
        if rows == list(range(rows[0], rows[0] + b)):
            sel: slice | torch.Tensor = slice(rows[0], rows[0] + b)
        else:
            sel = _upload(torch.tensor(rows, dtype=torch.long), self.device)
        dev = self.device
        up = {k: _upload(v, dev) for k, v in inputs.items()}
        row_idx = _upload(torch.tensor(rows, dtype=torch.long), dev)
        logits = self._device_forward(
            up["tokens"],
            up["parents"],
            up["lens"],
            row_idx,
            rows=sel,
            kv_len=kv_len,
            logits_to_keep=logits_to_keep,
            valid=self._real_tokens(inputs["parents"]),
            chains=chains if dev.type == "cpu" else None,
        )
        return logits, None

    def _real_tokens(self, parents: torch.Tensor) -> torch.Tensor | None:
        """Flat indices of the real tokens of a padded ``(b, n)`` batch (node 0 of each row, and
        every node with a parent; padding nodes are extra roots), for the fused forward on CPU
        where a GEMM costs what its rows cost; None when nothing is padding or elsewhere (on
        CUDA the padded shape runs the Triton kernels and costs about the same)."""
        if self._fused is None or self.device.type != "cpu":
            return None
        real = parents >= 0
        real[:, 0] = True
        if bool(real.all()):
            return None
        return real.reshape(-1).nonzero().squeeze(1)

    def _device_forward(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        lens: torch.Tensor,
        row_idx: torch.Tensor,
        *,
        rows: slice | torch.Tensor,
        kv_len: int,
        logits_to_keep: int,
        valid: torch.Tensor | None = None,
        chains: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """The model forward on device tensors (capturable: no host synchronization).

        Args:
            tokens, parents: ``(b, n)`` long (parent node index, -1 for a root);
            lens: ``(b,)`` long committed KV lengths; row_idx: ``(b,)`` long KV rows (the same
            rows as ``rows``, the slice or tensor the cache reads through).
            kv_len: key length of the attention (``>= max(lens) + n``).
            valid, chains: the fused forward's ``valid`` and ``chains``
                (:meth:`FusedLlama.forward`), or None (the Hugging Face forward ignores them).

        Returns float32 logits ``(b, n or logits_to_keep, V)``.
        """
        n = tokens.shape[1]
        dev = tokens.device
        anc, depth = ancestors(parents)
        positions = lens[:, None] + depth  # (b, n)
        key = torch.arange(kv_len, device=dev)
        rel = key[None, :] - lens[:, None]  # (b, kv): key position relative to the scratch
        committed = rel < 0
        slot = rel.clamp(0, n - 1)
        in_scratch = (rel >= 0) & (rel < n)
        anc_k = anc.gather(2, slot[:, None, :].expand(-1, n, -1))  # (b, n, kv)
        allowed = committed[:, None, :] | (in_scratch[:, None, :] & anc_k)
        mask = self._additive(allowed)
        if self._window is not None:
            key_pos = torch.where(committed, key[None, :], lens[:, None] + depth.gather(1, slot))
            in_window = positions[:, :, None] - key_pos[:, None, :] < self._window
            window_mask = self._additive(allowed & in_window)
            # layer_types models take one mask per layer type; others use the window everywhere
            mask = (
                {"full_attention": mask, "sliding_attention": window_mask}
                if self._per_layer_type
                else window_mask
            )
        write_pos = lens[:, None] + torch.arange(n, device=dev)
        if self._fused is not None:
            return self._fused.forward(
                tokens,
                positions,
                mask,
                self._store,
                row_idx,
                write_pos,
                rows,
                kv_len,
                logits_to_keep,
                valid,
                chains,
            )
        cache = _BatchCache(self._store, rows, row_idx, write_pos, kv_len)
        with torch.inference_mode():
            out = self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kw: cache},
            )
        return out.logits.float()

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """``(b, n, kv)`` bool -> ``(b, 1, n, kv)`` additive mask in the model dtype."""
        mask = torch.zeros(
            allowed.shape[0], 1, *allowed.shape[1:], dtype=self.dtype, device=self.device
        )
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype).min)
