"""Two :class:`~spec_grammar.worker.runner.ModelRunner` s driven through the same changing batch
(the shared loop of the runner comparison tests)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from spec_grammar.tree import DraftTree


def random_tree(rng: random.Random, root: int, n: int, vocab: int) -> DraftTree:
    """``n`` nodes: ``root`` then random tokens below ``vocab`` under random earlier nodes."""
    return DraftTree(
        [root] + [rng.randrange(vocab) for _ in range(n - 1)],
        [-1] + [rng.randrange(i) for i in range(1, n)],
    )


def first_child_path(tree: DraftTree) -> list[int]:
    """Nodes from the root down, each the first child of the one before (a valid accept path)."""
    path = [0]
    while path[-1] in tree.parent_list[1:]:
        path.append(tree.parent_list.index(path[-1], 1))
    return path


def compare_under_churn(
    a,
    b,
    rng: random.Random,
    *,
    steps: int,
    new_every: int,
    prompt_lens: Sequence[int],
    tree_sizes: Sequence[int],
    vocab: int,
    check: Callable[[torch.Tensor, torch.Tensor, int], None],
    subsets: bool = False,
) -> None:
    """Every ``new_every`` steps a request joins both runners (a prompt of a random length from
    ``prompt_lens``); each step verifies one random tree per request (every third step only a
    reversed subset of them when ``subsets``), hands each request's rows of ``a`` and ``b`` to
    ``check(rows_a, rows_b, step)``, then commits the first-child path in both; their cache
    lengths must stay equal."""
    roots: dict[str, int] = {}
    for step in range(steps):
        if step % new_every == 0:
            rid, prompt = f"r{step}", [rng.randrange(vocab) for _ in range(rng.choice(prompt_lens))]
            for r in (a, b):
                r.add(rid, prompt)
            roots[rid] = prompt[-1]
        rids = sorted(roots)
        if subsets and step % 3 == 2:
            rids = rids[::-2]
        trees = [random_tree(rng, roots[rid], rng.choice(tree_sizes), vocab) for rid in rids]
        out_a, out_b = a.forward_trees(rids, trees), b.forward_trees(rids, trees)
        for i, t in enumerate(trees):
            check(out_a[i, : t.num_nodes], out_b[i, : t.num_nodes], step)
        for rid, t in zip(rids, trees):
            path = first_child_path(t)
            for r in (a, b):
                r.commit(rid, path)
            roots[rid] = t.token_list[path[-1]]
            assert a.cache_len(rid) == b.cache_len(rid)
