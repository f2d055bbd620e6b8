"""Our forward for Llama-family decoders: merged projections, one kernel per non-GEMM step.

Why: inside a CUDA graph, launch cost is gone but kernel count is not. Hugging Face's Llama
layer runs ~51 kernels (RMSNorm as ~8 elementwise kernels, rotary as ~14, three q/k/v and two
gate/up GEMMs, the cache write as ``index_put``), each a few microseconds on a tiny batch: a
Llama-3.1-8B verify forward at batch 1 took 8.4 ms on an H200 against 3.9 ms to read its
weights, half of it outside the GEMMs. Per layer this forward runs: RMSNorm (with the residual
add), the merged QKV GEMM, rotary + KV write, attention, the head transpose, the O GEMM,
add + RMSNorm, the merged gate/up GEMM, SiLU * up, the down GEMM; 10-11 kernels, the layout of
vLLM's ``LlamaModel`` (``QKVParallelLinear``, ``MergedColumnParallelLinear``, fused add-RMSNorm
and rotary kernels).

Grouped-query attention folds each KV head's query heads into query rows: q viewed as
``(b, kv_heads, group * n, D)`` attends to the ``(b, kv_heads, kv, D)`` cache directly (no
``repeat_kv`` copy), with the ``(b, 1, n, kv)`` tree mask tiled ``group`` times along its rows
once per forward. On CPU in float32, up to :data:`.cpu_attention.MAX_QUERIES` tokens per
request, attention runs :mod:`.cpu_attention`'s kernel instead: it reads each request's keys
and values in place in the store (no ``k_buf[rows]`` copy), takes the untiled mask, skips the
padding tokens after each request's last real one, and writes the ``(b * n, heads * D)`` layout
the O projection takes; elsewhere (CUDA, other dtypes, more queries, no kernel) SDPA runs.

The weights stay the model's: the q/k/v (and gate/up) weights are copied once into one merged
tensor per layer and the HF parameters' data become views of it (the same ``Parameter``
objects, ``requires_grad`` kept), so no memory is duplicated, the HF forward still works and
an optimizer built earlier still updates what this forward reads (a self-draft that shares the
target's layers reuses the merged tensors). Only plain ``torch.nn.Linear`` projections are
accepted: a subclass (quantized, scaled) or an adapter wrapper (PEFT LoRA) computes something
else than ``F.linear`` over its weight.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import cpu_attention, ops

__all__ = ["FusedLlama", "unsupported_reason"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# rotary variants whose inverse frequencies are fixed at load time (dynamic ones change with length)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")

# merged weights per first module of a merge (q_proj, gate_proj), shared by every FusedLlama
# over the same layers: weak references, so that dropping the runners (then moving the model)
# frees them
_MERGED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[weakref.ref, weakref.ref | None]] = (
    weakref.WeakKeyDictionary()
)
_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`FusedLlama` cannot run ``model``, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    rotary = getattr(inner, "rotary_emb", None)
    if layers is None or rotary is None or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} lacks model.layers / model.rotary_emb / lm_head"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (supported: silu)"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        return f"rotary type {rope_type!r} (supported: {', '.join(_STATIC_ROPE)})"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window attention layers"
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    if len(layers) == 0:
        return "the model has no decoder layers"
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if hasattr(attn, "q_norm"):
            return f"attention module {type(attn).__name__} normalizes q/k (not Llama's)"
        for path in _PROJECTIONS:
            module = _submodule(layer, path)
            # exactly nn.Linear: a subclass (quantized, scaled) or an adapter wrapper (PEFT LoRA)
            # computes something else than F.linear over its weight
            if type(module) is not torch.nn.Linear:
                return f"layer {i} {path} is {type(module).__name__}, not a plain torch.nn.Linear"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(getattr(layer, norm, None), "variance_epsilon"):
                return f"layer {i} {norm} is not an RMSNorm with variance_epsilon"
    return None


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _merged(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``(sum of out_features, in_features)`` weight (and bias) for ``linears``; their
    parameters' data become views of it (the same ``Parameter`` objects, ``requires_grad``
    kept, so optimizers and the HF forward see what the fused forward computes with)."""
    first = linears[0]
    cached = _MERGED.get(first)
    if cached is not None:
        weight, bias = cached[0](), cached[1]() if cached[1] is not None else None
        if (
            weight is not None
            and weight.data_ptr() == first.weight.data_ptr()
            and ((bias is None) == (first.bias is None))
        ):
            return weight, bias
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None if first.bias is None else torch.cat([lin.bias.detach() for lin in linears])
        start = 0
        for lin in linears:
            stop = start + lin.weight.shape[0]
            lin.weight.data = weight[start:stop]
            if bias is not None:
                lin.bias.data = bias[start:stop]
            start = stop
    _MERGED[first] = (weakref.ref(weight), weakref.ref(bias) if bias is not None else None)
    return weight, bias


class _Layer:
    __slots__ = (
        "qkv_w",
        "qkv_b",
        "o",
        "gate_up_w",
        "gate_up_b",
        "down",
        "in_norm",
        "post_norm",
        "eps",
        "post_eps",
        "scaling",
    )

    def __init__(self, layer: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_w, self.qkv_b = _merged([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_w, self.gate_up_b = _merged([mlp.gate_proj, mlp.up_proj])
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.in_norm, self.post_norm = (
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
        )
        self.eps = float(layer.input_layernorm.variance_epsilon)
        self.post_eps = float(layer.post_attention_layernorm.variance_epsilon)
        self.scaling = float(attn.scaling)


class FusedLlama:
    """The decoder forward of a Llama-family ``transformers`` model (Llama, Mistral without
    sliding window, Qwen2), run on the runner's KV buffers.

    Args:
        model: the HF causal LM, already on its device (its q/k/v and gate/up parameters are
            data re-pointed to views of merged tensors; see the module docstring).

    Raises ``ValueError`` naming the reason when :func:`unsupported_reason` finds one.
    """

    def __init__(self, model: Any):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused decoder cannot run this model: {reason}")
        config, inner = model.config, model.model
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.group = self.heads // self.kv_heads
        self.embed = inner.embed_tokens.weight
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm, self.norm_eps = inner.norm.weight, float(inner.norm.variance_epsilon)
        self.lm_head = model.lm_head
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scaling = float(inner.rotary_emb.attention_scaling)
        self._kv_like = torch.empty(
            1, self.kv_heads, 1, self.head_dim, dtype=self.embed.dtype, device=self.embed.device
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        store: Any,
        row_idx: torch.Tensor,
        write_pos: torch.Tensor,
        rows: slice | torch.Tensor,
        kv_len: int,
        logits_to_keep: int = 0,
        valid: torch.Tensor | None = None,
        chains: Sequence[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """One forward of ``b`` requests' ``n`` tokens each (capturable: no host synchronization).

        Args:
            tokens, positions: ``(b, n)`` long.
            mask: ``(b, 1, n, kv_len)`` additive attention mask in the model dtype.
            store: the runner's KV store (``layer(i, like) -> (k_buf, v_buf)``, buffers
                ``(rows, kv_heads, capacity, head_dim)``).
            row_idx: ``(b,)`` long cache rows; write_pos: ``(b, n)`` long positions the tokens'
                KV is written at; rows: the same rows as a slice or long tensor (for reading).
            logits_to_keep: logits of the last this-many tokens only (0: all).
            valid: ``(T,)`` long indices into the ``b * n`` tokens of those that are real (the
                others are padding): the projections, norms and the LM head run on these ``T``
                rows only and only their KV is written (attention still runs on the padded
                ``(b, n)`` layout); the logits of padding rows are zero. None: all ``b * n``.
                On CPU, where a GEMM's cost grows with its rows, this skips the padding of
                ragged trees; CUDA-graph forwards leave it None (a fixed shape per bucket).
            chains: per request ``(committed, length)`` where its tokens are a chain (a prefill
                chunk): its first ``length`` tokens follow the ``committed`` keys of its row,
                each attending to those and the chain before it, and ``valid`` (or no padding)
                keeps exactly those. Attention then runs per request on its own ``length``
                queries and ``committed + length`` keys, causal without a mask where nothing is
                committed (``mask`` unread), instead of on the padded ``(b, n, kv_len)`` layout
                through the mask: at 12 prompts of 136-359 tokens, 3.4x less attention time on
                CPU. Not capturable (a host loop over the requests); None: the padded layout.

        Returns float32 logits ``(b, n or logits_to_keep, V)``.
        """
        b, n = tokens.shape
        tok, pos, wpos = tokens.reshape(-1), positions.reshape(-1), write_pos.reshape(-1)
        flat_rows = None
        if valid is not None:
            flat_rows = row_idx[:, None].expand(b, n).reshape(-1)[valid]
            tok, pos, wpos = tok[valid], pos[valid], wpos[valid]
        h = F.embedding(tok, self.embed)  # the residual stream, updated in place
        cos, sin = ops.rotary_cos_sin(pos, self.inv_freq, self.rope_scaling, self.embed.dtype)
        # on CPU the small-batch kernel reads the store in place (None: SDPA)
        kernel = None if chains is not None else self._kernel_inputs(mask, valid, b, n)
        sdpa_mask = None if kernel is not None or chains is not None else self._sdpa_mask(mask)
        chain_rows = row_idx.tolist() if chains is not None else None
        rows_at, capacity = None, 0  # the kernel's row indices into buffers of capacity rows
        x = ops.rms_norm(h, self.layers[0].in_norm, self.layers[0].eps)
        for i, layer in enumerate(self.layers):
            qkv = ops.linear(x, layer.qkv_w, layer.qkv_b)
            k_buf, v_buf = store.layer(i, self._kv_like)
            q = self._rope_and_cache(
                qkv, cos, sin, k_buf, v_buf, flat_rows, wpos, row_idx, valid, b, n
            )
            if chains is not None:
                attn = self._chain_attention(
                    q, k_buf, v_buf, chain_rows, mask, chains, layer.scaling
                )
            else:
                attn = None
                if kernel is not None:
                    if rows_at is None or capacity != k_buf.shape[0]:
                        capacity = k_buf.shape[0]
                        rows_at = cpu_attention.row_indices(rows, capacity)
                    if rows_at is not None:
                        attn = cpu_attention.attention(
                            q, k_buf, v_buf, rows_at, kv_len, mask, layer.scaling, kernel
                        )
                if attn is not None:
                    attn = attn.view(b * n, -1)
                else:
                    if sdpa_mask is None:
                        sdpa_mask = self._sdpa_mask(mask)
                    attn = F.scaled_dot_product_attention(
                        q.view(b, self.kv_heads, self.group * n, self.head_dim),
                        k_buf[rows, :, :kv_len],
                        v_buf[rows, :, :kv_len],
                        attn_mask=sdpa_mask,
                        scale=layer.scaling,
                    )
                    # (memory-efficient attention may return a non-contiguous output: reshape)
                    attn = attn.reshape(b, self.heads, n, self.head_dim).transpose(1, 2)
                    attn = attn.reshape(b * n, -1)
                if valid is not None:
                    attn = attn[valid]
            x = ops.rms_norm(
                ops.linear(attn, layer.o.weight, layer.o.bias),
                layer.post_norm,
                layer.post_eps,
                residual=h,
            )
            up = ops.silu_mul(ops.linear(x, layer.gate_up_w, layer.gate_up_b))
            mlp = ops.linear(up, layer.down.weight, layer.down.bias)
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            x = ops.rms_norm(
                mlp,
                nxt.in_norm if nxt else self.norm,
                nxt.eps if nxt else self.norm_eps,
                residual=h,
            )
        if logits_to_keep:
            x = self._padded(x, valid, b * n).view(b, n, -1)[:, -logits_to_keep:]
            return self._head(x.reshape(-1, x.shape[-1])).view(b, logits_to_keep, -1)
        return self._padded(self._head(x), valid, b * n).view(b, n, -1)

    def _chain_attention(self, q, k_buf, v_buf, rows, mask, chains, scaling) -> torch.Tensor:
        """Attention of prefill chains (:meth:`forward`'s ``chains``): ``(sum(length), heads *
        head_dim)``, the requests' tokens in order (the rows ``valid`` keeps)."""
        outs = []
        for j, (committed, length) in enumerate(chains):
            keys = committed + length
            row = rows[j]
            outs.append(
                F.scaled_dot_product_attention(
                    q[j : j + 1, :, :length],
                    k_buf[row, :, :keys][None],
                    v_buf[row, :, :keys][None],
                    # a chain on an empty row is a causal square (no mask needed); after
                    # committed keys its causal corner is bottom-right aligned, which is_causal
                    # (top-left) is not: then this request's rows of the mask
                    attn_mask=None if committed == 0 else mask[j : j + 1, :, :length, :keys],
                    is_causal=committed == 0,
                    scale=scaling,
                    enable_gqa=self.group > 1,
                )[0]
                .transpose(0, 1)
                .reshape(length, -1)
            )
        return torch.cat(outs)

    def _sdpa_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The ``(b, 1, group * n, kv)`` mask SDPA takes: row ``g * n + i`` is query ``i`` of
        group member ``g``."""
        return mask.repeat(1, 1, self.group, 1) if self.group > 1 else mask

    def attends_unpadded(self, n: int) -> bool:
        """Whether a forward of trees of at most ``n`` nodes runs attention on each request's
        own tokens only (the CPU attention kernel: CPU, float32, ``n`` at most
        :data:`.cpu_attention.MAX_QUERIES`, the kernel built), not the batch padded to ``n``."""
        return (
            self.embed.device.type == "cpu"
            and self.embed.dtype == torch.float32
            and n <= cpu_attention.MAX_QUERIES
            and cpu_attention.available()
        )

    def _kernel_inputs(self, mask, valid, b, n) -> torch.Tensor | None:
        """The ``queries`` argument of :func:`.cpu_attention.attention` (``(b,)`` long: each
        request's tokens up to its last real one; the rest are padding, discarded after
        attention) where the kernel may run this forward (CPU, float32, at most
        :data:`.cpu_attention.MAX_QUERIES` tokens per request, the kernel built), else None."""
        if not (
            mask.device.type == "cpu"
            and mask.dtype == torch.float32
            and n <= cpu_attention.MAX_QUERIES
            and cpu_attention.available()
        ):
            return None
        queries = torch.full((b,), n, dtype=torch.long)
        if valid is not None:
            last = valid % n + 1
            queries = torch.zeros(b, dtype=torch.long).scatter_reduce_(0, valid // n, last, "amax")
        return queries

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``(T, V)`` of the final hidden states ``x (T, H)``."""
        return ops.linear(x, self.lm_head.weight, self.lm_head.bias).float()

    @staticmethod
    def _padded(x: torch.Tensor, valid: torch.Tensor | None, total: int) -> torch.Tensor:
        """The ``(total, ...)`` tensor with ``x``'s rows at ``valid`` and zeros elsewhere
        (``x`` itself when ``valid`` is None)."""
        if valid is None:
            return x
        out = x.new_zeros(total, *x.shape[1:])
        out[valid] = x
        return out

    def _rope_and_cache(self, qkv, cos, sin, k_buf, v_buf, flat_rows, wpos, row_idx, valid, b, n):
        """Rotated queries ``(b, heads, n, head_dim)`` contiguous (zeros at padding), with the
        KV of the ``valid`` tokens (all when None) written to the cache."""
        dims = (self.heads, self.kv_heads, self.head_dim)
        if valid is None:
            return ops.rope_and_cache(
                qkv, cos, sin, k_buf, v_buf, row_idx, wpos.view(b, n), b, n, *dims
            )
        q = ops.rope_and_cache_rows(qkv, cos, sin, k_buf, v_buf, flat_rows, wpos, *dims)
        q = self._padded(q, valid, b * n).view(b, n, self.heads, self.head_dim)
        return q.transpose(1, 2).contiguous()
