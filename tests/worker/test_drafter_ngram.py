"""Prompt-lookup draft trees (:func:`ngram_tree`) against a direct reading of their definition."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from spec_grammar.worker.drafters import NgramDrafter, ngram_tree
from spec_grammar.worker.request import Request, RequestState


def reference_tree(ctx, num_draft_tokens, max_match=8, min_match=1, max_depth=None):
    """Suffix lengths from the longest down; for each, every earlier occurrence of the suffix
    (ending before the last token), most recent first, each occurrence used once; its following
    tokens go into a trie rooted at the last token until the node cap."""
    budget = num_draft_tokens - 1
    depth = budget if max_depth is None else max_depth
    tokens, parents, children = [ctx[-1] if ctx else -1], [-1], [{}]
    if budget <= 0 or depth <= 0 or len(ctx) < 2:
        return tokens, parents
    used = set()
    for n in range(min(max_match, len(ctx) - 1), min_match - 1, -1):
        suffix = ctx[len(ctx) - n :]
        for p in range(len(ctx) - 1, n - 1, -1):
            if p in used or ctx[p - n : p] != suffix:
                continue
            used.add(p)
            node = 0
            for t in ctx[p : p + depth]:
                if t not in children[node]:
                    if budget == 0:
                        return tokens, parents
                    children[node][t] = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                    children.append({})
                    budget -= 1
                node = children[node][t]
            if budget == 0:
                return tokens, parents
    return tokens, parents


@settings(max_examples=400, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 4), max_size=60),
    cap=st.integers(1, 20),
    max_match=st.integers(1, 9),
    min_match=st.integers(1, 4),
    max_depth=st.one_of(st.none(), st.integers(0, 6)),
)
def test_matches_the_definition(ctx, cap, max_match, min_match, max_depth):
    min_match = min(min_match, max_match)
    tree = ngram_tree(ctx, cap, max_match=max_match, min_match=min_match, max_depth=max_depth)
    assert (tree.token_list, tree.parent_list) == reference_tree(
        ctx, cap, max_match, min_match, max_depth
    )
    assert tree.num_nodes <= max(1, cap)


def test_longer_then_more_recent_matches_come_first():
    # suffix "1 2": "1 2" occurs at 0-1 (then 7) and 3-4 (then 8); "2" alone at 5 (then 9)
    ctx = [1, 2, 7, 1, 2, 8, 2, 9, 1, 2]
    tree = ngram_tree(ctx, 4, max_depth=1)
    assert tree.token_list == [2, 8, 7, 9] and tree.parent_list == [-1, 0, 0, 0]


def test_drafter_builds_one_tree_per_request_from_its_growing_context():
    states = [
        RequestState(Request([5, 6], rid="a"), [5, 6], None),
        RequestState(Request([1], rid="b"), [1], None),
    ]
    drafter = NgramDrafter(num_draft_tokens=3)
    rng = random.Random(0)
    for _ in range(200):  # the context buffer grows past its first size several times
        for state in states:
            state.output_ids.extend(rng.choice([5, 6, 7]) for _ in range(rng.randint(0, 3)))
        trees = drafter.propose(states)
        for state, tree in zip(states, trees):
            assert state.committed_array().tolist() == state.committed_ids
            assert (tree.token_list, tree.parent_list) == reference_tree(state.committed_ids, 3)
