"""Draft trees grown along real valid instances, the same trees for every backend.

Method of ``shared/notes/backend-libraries.md`` (appendix): the root is the state after the
first ``p`` tokens of a valid instance; children are added breadth-first with branching
4 / 2 / 2 / 1 by depth. A node on the true path gets the instance's next token as its first
child; every other child of a valid node is, with probability 0.65, a token every backend
allows there (specials and stop tokens excluded), otherwise a token no backend allows. Invalid
nodes still get (arbitrary) children, which a correct fill never visits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.protocol import SpecGrammar
from spec_grammar.tree import DraftTree

__all__ = ["BRANCHING", "P_VALID", "TreeRoot", "allowed_ids", "grow_tree"]

BRANCHING = (4, 2, 2, 1)
"""Children per node by depth (the last entry repeats for deeper nodes)."""
P_VALID = 0.65
"""Probability that an off-path child of a valid node is a valid token."""


@dataclass
class TreeRoot:
    """One request's draft tree and where it starts.

    Attributes:
        case: name of the grammar case.
        position: number of instance tokens accepted before the root.
        prefix: those token ids.
        tree: the draft tree (``tree.num_nodes`` = N).
        expected_valid: number of nodes (root included) every backend accepts.
    """

    case: str
    position: int
    prefix: list[int]
    tree: DraftTree
    expected_valid: int


def allowed_ids(matcher: SpecGrammar) -> np.ndarray:
    """``(V,)`` bool: tokens ``matcher`` allows next (its state is unchanged)."""
    info = matcher.info
    buf = allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(buf, 0)
    bits = np.unpackbits(buf.numpy()[0].view(np.uint8), bitorder="little")
    return bits[: info.vocab_size].astype(bool)


def grow_tree(
    matchers: Sequence[SpecGrammar],
    instance: Sequence[int],
    position: int,
    num_nodes: int,
    rng: random.Random,
    excluded: np.ndarray,
) -> tuple[DraftTree, int]:
    """Grow an ``num_nodes``-node tree from the state after ``instance[:position]``.

    ``matchers``: one per backend, each already at that state (left unchanged: children are
    explored on forks). ``excluded``: ``(V,)`` bool, tokens never drawn as valid children
    (specials, stop tokens). Returns the tree and its number of valid nodes (root included).
    """
    vocab = matchers[0].info.tokenizer_vocab_size
    tokens = [instance[position - 1] if position > 0 else 0]
    parents = [-1]
    depth = [0]
    on_path = [True]
    state: list[list[SpecGrammar] | None] = [list(matchers)]
    masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    frontier = 0
    while len(tokens) < num_nodes and frontier < len(tokens):
        node = frontier
        frontier += 1
        d = depth[node]
        branching = BRANCHING[min(d, len(BRANCHING) - 1)]
        true_index = position + d  # instance index of the true next token below a path node
        used: set[int] = set()
        for k in range(branching):
            if len(tokens) >= num_nodes:
                break
            child_on_path = False
            if state[node] is None:
                tok = rng.randrange(vocab)
            elif on_path[node] and k == 0 and true_index < len(instance):
                tok, child_on_path = instance[true_index], True
            else:
                if node not in masks:
                    each = [allowed_ids(m)[:vocab] for m in state[node]]
                    masks[node] = (np.logical_and.reduce(each), np.logical_or.reduce(each))
                both, either = masks[node]
                pool = both & ~excluded if rng.random() < P_VALID else ~either & ~excluded
                pool[list(used)] = False
                ids = np.flatnonzero(pool)
                tok = int(ids[rng.randrange(len(ids))]) if len(ids) else rng.randrange(vocab)
            used.add(tok)
            child_state = None
            if state[node] is not None:
                forks = [m.fork() for m in state[node]]
                if all(f.accept_token(tok) for f in forks) and not any(
                    f.is_terminated() for f in forks
                ):
                    child_state = forks
            tokens.append(tok)
            parents.append(node)
            depth.append(d + 1)
            on_path.append(child_on_path)
            state.append(child_state)
    valid = sum(s is not None for s in state)
    return DraftTree.from_parents(tokens, parents), valid
