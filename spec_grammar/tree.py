"""Draft trees with SGLang-compatible links.

A request's draft tree has ``N`` nodes. Node 0 is the root: the last committed token, already
accepted by the grammar. Every other node ``n`` carries a draft token ``tokens[n]`` whose parent
is ``parents[n] < n`` (nodes are topologically ordered, as SGLang's ``build_tree_kernel`` emits
them). Links (all ``torch.int64``, shape ``(N,)``, CPU):

- ``tokens``: draft token ids (``-1`` and ids outside the vocabulary are allowed: such nodes
  are simply invalid);
- ``parents``: parent index, ``-1`` for the root;
- ``retrieve_next_token``: first child, ``-1`` if none;
- ``retrieve_next_sibling``: next sibling (same parent, increasing index), ``-1`` if none;
- ``depth``: 0 for the root.

A chain (``topk=1`` drafts) is the tree whose node ``i`` is the only child of ``i-1``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from .errors import DraftTreeError

__all__ = ["DraftTree"]


def _as_long_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise DraftTreeError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype == torch.bool or values.dtype.is_floating_point or values.dtype.is_complex:
            # int() would truncate 0.7 to 0 silently; a float list is rejected, so is this
            raise DraftTreeError(
                f"{name} must be a sequence of ints: dtype {values.dtype} is not an integer dtype"
            )
        return [int(v) for v in values.tolist()]
    try:
        out = [operator.index(v) for v in values]
    except TypeError as e:
        raise DraftTreeError(f"{name} must be a sequence of ints: {e}") from None
    if any(not -(2**63) <= v < 2**63 for v in out):
        raise DraftTreeError(f"{name} holds a value outside int64")
    return out


class DraftTree:
    """An immutable draft tree. Build it with :meth:`from_parents`, :meth:`from_sglang` or
    :meth:`chain`; do not call the constructor with unchecked links.

    Attributes are CPU ``torch.int64`` tensors of shape ``(N,)``; ``token_list``,
    ``parent_list``, ``first_child_list``, ``next_sibling_list`` are the same as Python lists
    (host-side traversals read those).
    """

    __slots__ = (
        "token_list",
        "parent_list",
        "first_child_list",
        "next_sibling_list",
        "__dict__",
    )

    def __init__(self, tokens: list[int], parents: list[int]):
        n = len(tokens)
        if n == 0:
            raise DraftTreeError("a draft tree needs at least the root node")
        if len(parents) != n:
            raise DraftTreeError(f"tokens has {n} entries but parents has {len(parents)}")
        if parents[0] != -1:
            raise DraftTreeError(f"node 0 is the root: parents[0] must be -1, got {parents[0]}")
        first_child = [-1] * n
        next_sibling = [-1] * n
        last_child = [-1] * n
        for i in range(1, n):
            p = parents[i]
            if not 0 <= p < i:
                raise DraftTreeError(
                    f"parents[{i}] = {p}: every non-root node needs a parent with a smaller index"
                )
            if first_child[p] == -1:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        self.token_list = tokens
        self.parent_list = parents
        self.first_child_list = first_child
        self.next_sibling_list = next_sibling

    @classmethod
    def _from_ordered_links(
        cls,
        tokens: list[int],
        parents: list[int],
        first_child: list[int],
        next_sibling: list[int],
    ) -> DraftTree:
        """A tree whose links the caller has checked to be exactly those :meth:`__init__`
        derives from ``parents`` (every child after its parent, siblings by increasing index,
        -1 where none): skips deriving them again (the SGLang hook's per-request cost)."""
        tree = cls.__new__(cls)
        tree.token_list = tokens
        tree.parent_list = parents
        tree.first_child_list = first_child
        tree.next_sibling_list = next_sibling
        return tree

    # -- builders ---------------------------------------------------------------------------
    @classmethod
    def from_parents(
        cls, tokens: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor
    ) -> DraftTree:
        """Tree from per-node tokens and parent indices (``parents[0] == -1``, ``parents[n] < n``).

        Raises :class:`~spec_grammar.errors.DraftTreeError` on inconsistent links.
        """
        return cls(_as_long_list(tokens, "tokens"), _as_long_list(parents, "parents"))

    @classmethod
    def chain(cls, root_token: int, draft_tokens: Sequence[int] | torch.Tensor) -> DraftTree:
        """A chain: ``root_token`` followed by ``draft_tokens`` one after another."""
        drafts = _as_long_list(draft_tokens, "draft_tokens")
        return cls([int(root_token)] + drafts, list(range(-1, len(drafts))))

    @classmethod
    def from_sglang(
        cls,
        draft_tokens: Sequence[int] | torch.Tensor,
        retrieve_next_token: Sequence[int] | torch.Tensor,
        retrieve_next_sibling: Sequence[int] | torch.Tensor,
    ) -> DraftTree:
        """Tree from SGLang's first-child / next-sibling links (one request's slice).

        Children must have larger indices than their parent and siblings must be listed in
        increasing index order, as SGLang's tree builder produces them. Raises
        :class:`~spec_grammar.errors.DraftTreeError` otherwise, or on a cycle.
        """
        tokens = _as_long_list(draft_tokens, "draft_tokens")
        nxt = _as_long_list(retrieve_next_token, "retrieve_next_token")
        sib = _as_long_list(retrieve_next_sibling, "retrieve_next_sibling")
        n = len(tokens)
        if not (len(nxt) == len(sib) == n):
            raise DraftTreeError(
                f"link arrays differ in length: tokens {n}, next_token {len(nxt)}, "
                f"next_sibling {len(sib)}"
            )
        if sib[0] != -1:
            raise DraftTreeError("the root (node 0) cannot have a sibling")
        parents = [-2] * n
        parents[0] = -1
        stack = [0]
        while stack:
            p = stack.pop()
            c = nxt[p]
            while c != -1:
                if not 0 < c < n or parents[c] != -2:
                    raise DraftTreeError(f"node {c} is out of range or reached twice")
                parents[c] = p
                stack.append(c)
                c = sib[c]
        missing = [i for i in range(n) if parents[i] == -2]
        if missing:
            raise DraftTreeError(f"nodes {missing[:8]} are not reachable from the root")
        tree = cls(tokens, parents)
        if tree.first_child_list != nxt or tree.next_sibling_list != sib:
            raise DraftTreeError(
                "links are not in SGLang order (children after their parent, siblings by "
                "increasing index)"
            )
        return tree

    def subtree(self, keep: Sequence[int] | torch.Tensor) -> DraftTree:
        """The tree of the nodes ``keep`` (ascending node indices, the root first, each node's
        parent kept; a sequence of ints or a 1-D integer tensor), in their order. Raises
        :class:`~spec_grammar.errors.DraftTreeError` when ``keep`` is not such a set."""
        keep = _as_long_list(keep, "keep")
        index = {old: new for new, old in enumerate(keep)}
        if not keep or keep[0] != 0 or keep != sorted(index):
            raise DraftTreeError(f"keep must list ascending node indices from the root, got {keep}")
        parents = [-1]
        for i in keep[1:]:
            p = self.parent_list[i] if 0 <= i < self.num_nodes else None
            if p not in index:
                raise DraftTreeError(f"node {i} is kept without its parent (or does not exist)")
            parents.append(index[p])
        return DraftTree([self.token_list[i] for i in keep], parents)

    # -- views ------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.token_list)

    def __len__(self) -> int:
        return len(self.token_list)

    @cached_property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.token_list, dtype=torch.int64)

    @cached_property
    def parents(self) -> torch.Tensor:
        return torch.tensor(self.parent_list, dtype=torch.int64)

    @cached_property
    def retrieve_next_token(self) -> torch.Tensor:
        return torch.tensor(self.first_child_list, dtype=torch.int64)

    @cached_property
    def retrieve_next_sibling(self) -> torch.Tensor:
        return torch.tensor(self.next_sibling_list, dtype=torch.int64)

    @cached_property
    def depth_list(self) -> list[int]:
        depth = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depth[i] = depth[self.parent_list[i]] + 1
        return depth

    @cached_property
    def max_depth(self) -> int:
        return max(self.depth_list)

    @cached_property
    def depth(self) -> torch.Tensor:
        """``(N,)`` int64: 0 for the root, parent depth + 1 otherwise."""
        return torch.tensor(self.depth_list, dtype=torch.int64)

    def children(self, node: int) -> list[int]:
        out = []
        c = self.first_child_list[node]
        while c != -1:
            out.append(c)
            c = self.next_sibling_list[c]
        return out

    def path(self, node: int) -> list[int]:
        """Draft tokens on the path root..node, root token excluded (the grammar input)."""
        toks = []
        while node > 0:
            toks.append(self.token_list[node])
            node = self.parent_list[node]
        return toks[::-1]

    def path_nodes(self, node: int) -> list[int]:
        """Node indices root..node, root included."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent_list[node]
        return nodes[::-1]

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``(N, N)`` bool: ``[i, j]`` is True when ``j`` is ``i`` or an ancestor of ``i`` (the
        tree-attention pattern). Built from one Python-int bitset per node (a node's set is its
        parent's plus itself), unpacked once: a batch of 64-node trees per verify step makes
        per-row tensor ops the host's largest cost."""
        n = self.num_nodes
        bits = [0] * n
        for i, p in enumerate(self.parent_list):
            bits[i] = (bits[p] if p >= 0 else 0) | (1 << i)
        width = (n + 7) // 8
        packed = np.frombuffer(b"".join(b.to_bytes(width, "little") for b in bits), dtype=np.uint8)
        rows = np.unpackbits(packed.reshape(n, width), axis=1, bitorder="little")[:, :n]
        return torch.from_numpy(rows.astype(bool))

    def __repr__(self) -> str:
        return f"DraftTree(tokens={self.token_list}, parents={self.parent_list})"
