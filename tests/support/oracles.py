"""Oracles for the worker's greedy tree verification: the per-request path (fill the tree's
rows on the request's matcher, then walk the masked greedy tokens down the tree) and the
matcher state a walk must leave (compared with a fresh matcher fed the same committed run)."""

from __future__ import annotations

import torch

from spec_grammar import GrammarStateError, allocate_token_bitmask
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy


def oracle_verify(m, logits, tree, stops):
    """``(nodes, bonus)`` of the per-request path from matcher ``m``'s state (left as it was),
    or its error type."""
    if m.is_terminated():
        return GrammarStateError
    rows = allocate_token_bitmask(tree.num_nodes, logits.shape[-1])
    valid = m.fill_tree_bitmask(tree, rows)
    processed = process_tree_logits(
        logits, tree, [tree.token_list[0]], SamplingParams(), bitmask=rows
    )
    try:
        return verify_greedy(processed, tree, valid, stop_token_ids=stops)
    except GrammarStateError:
        return GrammarStateError


def state_error(m, ref, run: list[int]) -> str | None:
    """None when ``m`` is where ``ref`` (a fresh matcher at the same prefix) is once fed
    ``run``; else what differs. ``ref`` is advanced."""
    if ref.accept_tokens(run) != len(run):
        return "a fresh matcher refuses the committed run"
    if m.num_accepted != ref.num_accepted:
        return f"num_accepted {m.num_accepted} != {ref.num_accepted}"
    if ref.is_terminated() or m.is_terminated():
        return None if ref.is_terminated() == m.is_terminated() else "termination differs"
    a, b = (
        allocate_token_bitmask(1, m.info.vocab_size),
        allocate_token_bitmask(1, m.info.vocab_size),
    )
    m.fill_next_token_bitmask(a)
    ref.fill_next_token_bitmask(b)
    return None if torch.equal(a, b) else "next-token masks differ"


def row_of(m):
    """The matcher's next-token row, a fresh ``(W,)`` int32 array."""
    from spec_grammar import allocate_token_bitmask

    buf = allocate_token_bitmask(1, m.info.vocab_size)
    m.fill_next_token_bitmask(buf, 0)
    return buf.numpy()[0].copy()


def check_tree_against_replay(make, prefix: list[int], tokens: list[int], parents: list[int]):
    """``make()`` -> a fresh matcher. Fills the tree (``tokens``/``parents``) after ``prefix``
    and asserts every valid flag and row equals a fresh matcher replaying that node's path, and
    that the fill left the matcher where it was."""
    from spec_grammar import DraftTree, allocate_token_bitmask

    tree = DraftTree.from_parents(tokens, parents)
    m = make()
    assert m.accept_tokens(prefix) == len(prefix)
    buf = allocate_token_bitmask(len(tokens), m.info.vocab_size)
    valid = m.fill_tree_bitmask(tree, buf, 0).tolist()
    assert m.num_accepted == len(prefix)
    assert (row_of(m) == buf.numpy()[0]).all()
    for node in range(len(tokens)):
        path, v = [], node
        while v > 0:
            path.append(tokens[v])
            v = parents[v]
        fresh = make()
        fresh.accept_tokens(prefix)
        ok = True
        for t in reversed(path):
            if fresh.is_terminated() or not fresh.accept_token(t):
                ok = False
                break
        assert valid[node] == ok, (node, path)
        if ok and not fresh.is_terminated():
            assert (buf.numpy()[node] == row_of(fresh)).all(), (node, path)
        else:
            assert not buf.numpy()[node].any(), (node, path)
