"""Sampling parameters and the per-node logits processing shared by speculative and plain decoding.

Plain (non-speculative) decoding is :func:`process_tree_logits` on a tree of just the root, so a
speculative step and a plain step see exactly the same processed distribution for a given
prefix: spec and no-spec agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..bitmask import apply_token_bitmask_inplace
from ..errors import BitmaskError, InvalidTokenError
from ..tree import DraftTree
from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "process_tree_logits", "make_generator"]


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``params.seed`` (or a random seed)."""
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def _path_token_counts(tree: DraftTree, vocab: int, device: torch.device) -> torch.Tensor:
    """``(N, V)`` float32: how often each token occurs on the draft path root..n, root token
    excluded (it is already in the context); out-of-range draft tokens are not counted."""
    n = tree.num_nodes
    tok = tree.tokens
    ok = (tok >= 0) & (tok < vocab)
    ok[0] = False
    onehot = torch.zeros(n, vocab, dtype=torch.float32)
    idx = ok.nonzero().flatten()
    onehot[idx, tok[idx]] = 1.0
    return (tree.ancestor_mask.float() @ onehot).to(device)


def _context_counts(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.long)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise InvalidTokenError(f"context ids must lie in [0, {vocab}), got {t.min()}..{t.max()}")
    return torch.bincount(t, minlength=vocab).float().to(device)


def process_tree_logits(
    logits: torch.Tensor,
    tree: DraftTree,
    context_ids: Sequence[int],
    params: SamplingParams,
    bitmask: torch.Tensor | None = None,
    *,
    prompt_len: int = 0,
) -> torch.Tensor:
    """Processed logits of every node of one request's draft tree.

    Row ``n`` gets exactly what plain sampling applies after the prefix
    ``context_ids + tree.path(n)``, in this order: repetition penalty (Hugging Face, prompt +
    output), frequency / presence penalties (OpenAI, output tokens only), logit bias, grammar
    mask, then (when ``temperature > 0``) temperature, top-k, top-p.

    Args:
        logits: ``(N, V)`` float logits of the tree's nodes (a slice of
            :meth:`ModelRunner.forward_trees`), any device. Not modified.
        tree: the request's draft tree (``N`` nodes; root = last committed token).
        context_ids: committed ids, prompt + output (the root token is the last one).
        params: the request's :class:`SamplingParams`.
        bitmask: ``(N, ceil(V/32))`` int32 grammar rows (from ``SpecGrammar.fill_tree_bitmask``),
            or ``None`` without a grammar. All-zero rows (invalid or terminated nodes) become
            all ``-inf``; the verifiers never sample from such a row.
        prompt_len: how many leading ``context_ids`` are prompt (excluded from frequency /
            presence counts).

    Returns:
        ``(N, V)`` float32 processed logits on ``logits``' device, ``-inf`` where disallowed;
        never NaN. With ``temperature == 0`` they are the masked, penalized logits (argmax
        decides); otherwise ``softmax`` of a row is the sampling distribution.

    Raises :class:`BitmaskError` on a shape mismatch and :class:`InvalidTokenError` for
    ``context_ids`` or ``logit_bias`` ids outside ``[0, V)``.
    """
    n = tree.num_nodes
    if logits.dim() != 2 or logits.shape[0] != n:
        raise BitmaskError(
            f"logits must be ({n}, V) for a {n}-node tree, got {tuple(logits.shape)}"
        )
    out = _penalized(
        logits.to(torch.float32, copy=True), tree, list(context_ids), params, prompt_len
    )
    if params.logit_bias:
        _add_logit_bias(out, params.logit_bias)
    if bitmask is not None:
        if bitmask.dim() != 2 or bitmask.shape[0] != n:
            raise BitmaskError(
                f"bitmask must have {n} rows (one per node), got {tuple(bitmask.shape)}"
            )
        apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True))
    if params.greedy:
        return out
    return _warped(out, params)


def _penalized(
    out: torch.Tensor,
    tree: DraftTree,
    context: list[int],
    params: SamplingParams,
    prompt_len: int,
) -> torch.Tensor:
    """``out`` ``(N, V)`` float32 with the repetition penalty (Hugging Face, prompt + output +
    path) and the frequency / presence penalties (OpenAI, output + path) applied; in place
    where it can be."""
    if (
        params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
    ):
        return out
    vocab, dev = out.shape[1], out.device
    path = _path_token_counts(tree, vocab, dev)
    if params.repetition_penalty != 1.0:
        seen = (_context_counts(context, vocab, dev) + path) > 0
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out < 0, out * rp, out / rp), out)
    if params.frequency_penalty or params.presence_penalty:
        counts = _context_counts(context[prompt_len:], vocab, dev) + path
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def _add_logit_bias(out: torch.Tensor, logit_bias: dict[int, float]) -> None:
    """Add ``logit_bias`` (token id -> value) to every row of ``out`` ``(N, V)``. Raises
    :class:`InvalidTokenError` for ids outside ``[0, V)``."""
    vocab, dev = out.shape[1], out.device
    ids = torch.tensor(list(logit_bias), dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise InvalidTokenError(
            f"logit_bias ids must lie in [0, {vocab}), got {sorted(logit_bias)}"
        )
    bias = torch.tensor(list(logit_bias.values()), dtype=torch.float32)
    out[:, ids.to(dev)] += bias.to(dev)


def _warped(out: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (Hugging Face warper semantics) on ``out``
    ``(N, V)``, in place; ``-inf`` where removed."""
    vocab = out.shape[1]
    out /= params.temperature
    if 0 < params.top_k < vocab:
        kth = torch.topk(out, params.top_k, dim=-1).values[:, -1:]
        out.masked_fill_(out < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(out, dim=-1)
        # fully masked rows give NaN here; NaN <= x is False, so they stay as they are
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= 1.0 - params.top_p
        remove_sorted[:, -1] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        out.masked_fill_(remove, float("-inf"))
    return out
