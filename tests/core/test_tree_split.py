"""Cutting one draft tree into pieces for parallel fills (:mod:`spec_grammar.tree_split`),
checked against the tree itself: the pieces' rows partition the nodes, each piece's local links
describe the piece's nodes under their real parents, its path is the real path to its anchor,
and the size bounds hold."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_grammar.tree import DraftTree
from spec_grammar.tree_split import piece_sizes, split_tree


@st.composite
def trees(draw):
    n = draw(st.integers(1, 70))
    rng = random.Random(draw(st.integers(0, 2**32)))
    bushy = draw(st.floats(0, 1))
    parents = [-1] + [rng.randrange(i) if rng.random() < bushy else i - 1 for i in range(1, n)]
    return DraftTree.from_parents([100 + i for i in range(n)], parents)


def _walk(links: np.ndarray) -> list[tuple[int, int]]:
    """(local parent, local child) pairs reached from local node 0 by the links."""
    pairs, stack = [], [0]
    while stack:
        u = stack.pop()
        c = int(links[0, u])
        while c >= 0:
            pairs.append((u, c))
            stack.append(c)
            c = int(links[1, c])
    return pairs


@settings(max_examples=300, deadline=None)
@given(trees(), st.integers(1, 24), st.data())
def test_pieces_partition_the_tree(tree, max_rows, data):
    n = tree.num_nodes
    cuttable = None
    if data.draw(st.booleans()):
        cuttable = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    pieces = split_tree(tree, max_rows, cuttable)
    owned = np.concatenate([p.rows for p in pieces])
    assert sorted(owned.tolist()) == list(range(n))  # each row written exactly once
    assert pieces[0].anchor == 0 and pieces[0].owns_anchor
    for p in pieces:
        assert p.nodes[0] == p.anchor
        assert p.anchor == 0 or cuttable is None or cuttable[p.anchor]
        assert list(p.path) == tree.path(p.anchor)
        pairs = _walk(p.links)
        assert sorted(c for _, c in pairs) == list(range(1, len(p.nodes)))  # a tree, all reached
        for u, c in pairs:
            assert tree.parent_list[p.nodes[c]] == p.nodes[u]
        assert p.links[2].tolist() == [tree.token_list[v] for v in p.nodes]


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(1, 24))
def test_piece_size_bound_when_every_node_is_cuttable(tree, max_rows):
    pieces = split_tree(tree, max_rows)
    if tree.num_nodes <= max_rows:
        assert len(pieces) == 1
    for p in pieces:
        assert len(p.rows) <= max_rows
        assert len(p.nodes) <= max_rows + 1


def test_chain_cut_into_equal_pieces():
    tree = DraftTree.chain(1, list(range(2, 65)))  # 64 nodes
    pieces = split_tree(tree, 16)
    assert sorted(len(p.rows) for p in pieces) == [16, 16, 16, 16]
    assert all(p.owns_anchor for p in pieces)  # subtrees only: no row walked twice


def test_bad_max_rows():
    with pytest.raises(ValueError, match="max_rows"):
        split_tree(DraftTree.chain(1, [2]), 0)


def test_piece_sizes():
    # one tree is 70% of the batch: cut into at most `threads` pieces; cheap ones stay whole
    costs = [70.0] + [1.0] * 30
    sizes = [64] * 31
    cuts = piece_sizes(costs, sizes, 8)
    assert cuts[0] == 8 and cuts[1:] == [0] * 30  # 8 pieces of 8 rows
    assert piece_sizes(costs, sizes, 1) == [0] * 31  # one thread: nothing to spread
    assert piece_sizes([None, 5.0], [64, 64], 4) == [0, 16]  # unknown costs are never cut
    assert piece_sizes([None, None], [64, 64], 4) == [0, 0]
    assert piece_sizes([9.0, 1.0], [1, 64], 4) == [0, 0]  # a root alone cannot be cut
