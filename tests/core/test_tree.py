"""DraftTree: link arrays against a brute-force reading of the same tree."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_grammar import DraftTree, DraftTreeError


@st.composite
def parent_arrays(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@given(parent_arrays())
@settings(max_examples=200, deadline=None)
def test_links_match_parents(parents):
    tokens = list(range(100, 100 + len(parents)))
    tree = DraftTree.from_parents(tokens, parents)
    n = len(parents)
    for node in range(n):
        assert tree.children(node) == [c for c in range(n) if parents[c] == node]
        # depth = number of hops to the root
        d, p = 0, node
        while parents[p] != -1:
            p, d = parents[p], d + 1
        assert tree.depth_list[node] == d
        assert tree.path_nodes(node)[0] == 0 and tree.path_nodes(node)[-1] == node
        assert tree.path(node) == [tokens[x] for x in tree.path_nodes(node)[1:]]
    # SGLang links round-trip
    again = DraftTree.from_sglang(tree.tokens, tree.retrieve_next_token, tree.retrieve_next_sibling)
    assert again.parent_list == parents
    # ancestor mask: row i marks exactly the path root..i
    am = tree.ancestor_mask
    for i in range(n):
        assert am[i].nonzero().flatten().tolist() == sorted(tree.path_nodes(i))
    assert tree.tokens.dtype == torch.int64 and tree.depth.shape == (n,)


def test_chain():
    t = DraftTree.chain(5, [6, 7, 8])
    assert t.parent_list == [-1, 0, 1, 2]
    assert t.retrieve_next_token.tolist() == [1, 2, 3, -1]
    assert t.retrieve_next_sibling.tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize(
    "tokens,parents,match",
    [
        ([], [], "at least the root"),
        ([1, 2], [-1], "parents has"),
        ([1, 2], [0, 0], "parents\\[0\\] must be -1"),
        ([1, 2, 3], [-1, 2, 0], "smaller index"),
        ([1, 2], [-1, 5], "smaller index"),
    ],
)
def test_bad_parents(tokens, parents, match):
    with pytest.raises(DraftTreeError, match=match):
        DraftTree.from_parents(tokens, parents)


@pytest.mark.parametrize(
    "parents",
    [
        [-1, 0.0],
        torch.tensor([-1, 0.0]),
        torch.tensor([-1, 0.7]),
        torch.tensor([-1, 0], dtype=torch.float16),
        torch.tensor([True, False]),
    ],
)
def test_non_integer_parents_are_rejected(parents):
    """A float or bool tensor is refused like a float list (``int()`` would truncate 0.7 to 0)."""
    with pytest.raises(DraftTreeError, match="parents must be a sequence of ints"):
        DraftTree.from_parents(torch.tensor([1, 2]), parents)
    with pytest.raises(DraftTreeError, match="draft_tokens must be a sequence of ints"):
        DraftTree.chain(1, torch.tensor([2.0, 3.0]))


def test_integer_tensors_of_any_width_are_accepted():
    for dtype in (torch.int32, torch.int64, torch.int16, torch.uint8):
        tokens = torch.tensor([1, 2, 3], dtype=dtype)
        parents = torch.tensor([-1, 0, 0], dtype=torch.int8 if dtype == torch.uint8 else dtype)
        t = DraftTree.from_parents(tokens, parents)
        assert t.parent_list == [-1, 0, 0] and t.token_list == [1, 2, 3]


def test_bad_sglang_links():
    with pytest.raises(DraftTreeError, match="sibling"):
        DraftTree.from_sglang([1, 2], [1, -1], [1, -1])
    with pytest.raises(DraftTreeError, match="reached twice|out of range"):
        DraftTree.from_sglang([1, 2, 3], [1, 1, -1], [-1, -1, -1])
    with pytest.raises(DraftTreeError, match="not reachable"):
        DraftTree.from_sglang([1, 2, 3], [1, -1, -1], [-1, -1, -1])
    with pytest.raises(DraftTreeError, match="length"):
        DraftTree.from_sglang([1, 2, 3], [1, -1], [-1, -1, -1])
