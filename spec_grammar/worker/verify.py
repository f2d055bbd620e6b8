"""Tree verification: which draft nodes the target model accepts, and the bonus token.

Both verifiers walk the draft tree from the root over :func:`process_tree_logits` rows and
return ``(accepted, bonus)``: ``accepted`` = node indices of the accepted path, root first
(``[0, a1, .., ak]``, what :meth:`ModelRunner.commit` takes) and ``bonus`` = the token sampled
after the path. The committed output grows by ``[tokens[a1], .., tokens[ak], bonus]``.

Rules shared by both:
- a child is a candidate only when it is ``valid`` (grammar) and its token lies in
  ``[0, V)``; an invalid node is never accepted, so neither is its subtree;
- a node whose token is a stop token (``stop_token_ids``) or whose processed row allows no
  token (the grammar terminated after it) is never expanded: when the walk picks such a child,
  its token becomes the bonus instead (same committed tokens, the walk ends there);
- if the row the bonus must come from allows no token (only possible at a terminated root),
  :class:`GrammarStateError` is raised.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ..errors import BitmaskError, GrammarStateError
from ..tree import DraftTree
from .sampling import SamplingParams

__all__ = ["verify", "verify_greedy", "verify_stochastic", "token_logprobs", "greedy_walk"]


def _check(processed: torch.Tensor, tree: DraftTree, valid: torch.Tensor | None) -> list[bool]:
    n = tree.num_nodes
    if processed.dim() != 2 or processed.shape[0] != n:
        raise BitmaskError(
            f"processed logits must be ({n}, V) for a {n}-node tree, got {tuple(processed.shape)}"
        )
    return node_validity(valid, n)


def node_validity(valid: torch.Tensor | None, n: int) -> list[bool]:
    """``valid`` (``(n,)`` bool from a tree fill, or None: all valid) as a list. Raises
    :class:`BitmaskError` on another shape."""
    if valid is None:
        return [True] * n
    if valid.shape != (n,):
        raise BitmaskError(f"valid must have shape ({n},), got {tuple(valid.shape)}")
    return [bool(v) for v in valid.tolist()]


def _candidates(tree: DraftTree, node: int, ok: list[bool], vocab: int) -> list[int]:
    return [c for c in tree.children(node) if ok[c] and 0 <= tree.token_list[c] < vocab]


def _dead_root(node: int) -> GrammarStateError:
    return GrammarStateError(
        f"the processed row of node {node} allows no token: nothing can be sampled (was the "
        "grammar already terminated at the root?)"
    )


def verify_greedy(
    processed: torch.Tensor,
    tree: DraftTree,
    valid: torch.Tensor | None = None,
    *,
    stop_token_ids: Collection[int] = (),
) -> tuple[list[int], int]:
    """Greedy verification: from the root, ``next = argmax(row)`` (ties -> lowest token id, as
    ``torch.argmax``); follow the first candidate child whose token is ``next``; otherwise
    ``next`` is the bonus.

    Args:
        processed: ``(N, V)`` float32 from :func:`process_tree_logits`, any device.
        tree: the draft tree (``N`` nodes).
        valid: ``(N,)`` bool from ``SpecGrammar.fill_tree_bitmask``; ``None`` = all valid.
        stop_token_ids: tokens never expanded (EOS and friends; empty with ``ignore_eos``).

    Returns ``(accepted nodes root first, bonus token)``; one device-to-host copy.
    """
    ok = _check(processed, tree, valid)
    # argmax/amax rather than max(dim): the latter is a slow path on CPU
    best = processed.argmax(dim=-1)
    alive_t = torch.isfinite(processed.amax(dim=-1)).to(best.dtype)
    best_list, alive = torch.stack([best, alive_t]).tolist()
    return greedy_walk(tree, best_list, alive, ok, processed.shape[1], stop_token_ids)


def greedy_walk(
    tree: DraftTree,
    best: list[int],
    alive: list[bool] | list[int],
    ok: list[bool],
    vocab: int,
    stop_token_ids: Collection[int] = (),
) -> tuple[list[int], int]:
    """The host half of greedy verification: walk ``tree`` from the root following the child
    whose token is ``best[node]`` (the row's argmax).

    Args:
        best: per node, the argmax token of its processed row.
        alive: per node, whether its processed row allows any token.
        ok: per node, grammar validity (``valid``; all True without a grammar).
        vocab: the logits width (draft tokens outside ``[0, vocab)`` are never followed).

    Returns ``(accepted nodes root first, bonus token)``; raises :class:`GrammarStateError`
    when the root row allows no token.
    """
    stops = set(stop_token_ids)
    if not alive[0]:
        raise _dead_root(0)
    accepted = [0]
    node = 0
    while True:
        target = best[node]
        nxt = next(
            (c for c in _candidates(tree, node, ok, vocab) if tree.token_list[c] == target), None
        )
        if nxt is None or target in stops or not alive[nxt]:
            return accepted, target
        accepted.append(nxt)
        node = nxt


def _probs(processed: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax in float64; rows that allow no token become all zero (never NaN)."""
    x = processed.double()
    top = x.amax(dim=-1, keepdim=True)
    dead = ~torch.isfinite(top)
    e = torch.exp(x - torch.where(dead, 0.0, top))
    s = e.sum(dim=-1, keepdim=True)
    return torch.where(dead, 0.0, e / torch.where(s > 0, s, 1.0))


def verify_stochastic(
    processed: torch.Tensor,
    tree: DraftTree,
    generator: torch.Generator,
    valid: torch.Tensor | None = None,
    *,
    stop_token_ids: Collection[int] = (),
) -> tuple[list[int], int]:
    """Tree speculative sampling, lossless w.r.t. sampling each row of ``processed``.

    Multi-step speculative sampling of SpecInfer (Miao et al., "SpecInfer: Accelerating Large
    Language Model Serving with Tree-based Speculative Inference and Verification", ASPLOS
    2024, Algorithm 2), the tree generalisation of speculative sampling (Chen et al.,
    "Accelerating Large Language Model Decoding with Speculative Sampling", 2023), with
    deterministic (point-mass) drafts: at an accepted node with target distribution
    ``p = softmax(row)``, try its candidate children in order; child token ``x`` is accepted
    with probability ``p(x) / 1``; on rejection set ``p(x) = 0`` and renormalise; if no child is
    accepted, the bonus is sampled from the residual ``p``. Each committed token is therefore
    distributed exactly as ``p`` of its prefix (temperature, top-k/top-p and the grammar mask
    are part of ``p``).

    Args:
        processed: ``(N, V)`` float32 from :func:`process_tree_logits` (``temperature > 0``).
        tree: the draft tree (``N`` nodes).
        generator: the request's ``torch.Generator`` (any device; the bonus draw runs there).
            Every call draws ``N`` uniforms, then one multinomial sample when no child of the
            last accepted node is accepted.
        valid: ``(N,)`` bool from ``SpecGrammar.fill_tree_bitmask``; ``None`` = all valid.
        stop_token_ids: tokens never expanded.

    Returns ``(accepted nodes root first, bonus token)``.
    """
    ok = _check(processed, tree, valid)
    n, vocab = processed.shape
    probs = _probs(processed)
    cand = {u: _candidates(tree, u, ok, vocab) for u in range(n)}
    edges = [(u, c) for u in range(n) for c in cand[u]]
    gdev = generator.device
    uniforms = torch.rand(n, generator=generator, device=gdev, dtype=torch.float64).tolist()
    if edges:
        rows = torch.tensor([u for u, _ in edges], device=probs.device)
        cols = torch.tensor([tree.token_list[c] for _, c in edges], device=probs.device)
        p_edge = dict(zip(edges, probs[rows, cols].tolist()))
    alive = (probs.sum(dim=-1) > 0).tolist()
    if not alive[0]:
        raise _dead_root(0)
    stops = set(stop_token_ids)
    draws = iter(uniforms)
    accepted = [0]
    node = 0
    while True:
        rejected: dict[int, float] = {}
        mass = 1.0
        chosen = None
        for c in cand[node]:
            x = tree.token_list[c]
            if x in rejected:
                continue  # residual p(x) is already 0
            px = p_edge[(node, c)]
            # mass <= px happens only through rounding when x holds all remaining mass
            if mass <= px or next(draws) * mass < px:
                chosen = c
                break
            rejected[x] = px
            mass -= px
        if chosen is None:
            residual = probs[node].clone()
            if rejected:
                residual[torch.tensor(list(rejected), device=residual.device)] = 0.0
            if float(residual.sum()) <= 0.0:
                raise _dead_root(node)
            bonus = torch.multinomial(residual.to(gdev), 1, generator=generator)
            return accepted, int(bonus)
        x = tree.token_list[chosen]
        if x in stops or not alive[chosen]:
            return accepted, x
        accepted.append(chosen)
        node = chosen


def verify(
    processed: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
    *,
    stop_token_ids: Collection[int] = (),
) -> tuple[list[int], int]:
    """:func:`verify_greedy` when ``params.temperature == 0``, else :func:`verify_stochastic`
    (which needs ``generator``; ``ValueError`` without one)."""
    if params.greedy:
        return verify_greedy(processed, tree, valid, stop_token_ids=stop_token_ids)
    if generator is None:
        raise ValueError("stochastic verification (temperature > 0) needs a torch.Generator")
    return verify_stochastic(processed, tree, generator, valid, stop_token_ids=stop_token_ids)


def token_logprobs(
    processed: torch.Tensor, tree: DraftTree, accepted: list[int], bonus: int
) -> list[float]:
    """Log-probabilities of the committed tokens ``[tokens[a1], .., tokens[ak], bonus]`` under
    the processed distributions (row ``a_{i-1}`` for ``tokens[a_i]``, row ``ak`` for the bonus):
    ``log_softmax(processed)``, so with ``temperature == 0`` they are the masked model
    log-probs. ``(N, V)`` float32 in, ``k + 1`` floats out."""
    tokens = [tree.token_list[a] for a in accepted[1:]] + [int(bonus)]
    dev = processed.device
    logp = torch.log_softmax(processed[torch.tensor(accepted, device=dev)].double(), dim=-1)
    return logp.gather(1, torch.tensor(tokens, device=dev)[:, None])[:, 0].tolist()
