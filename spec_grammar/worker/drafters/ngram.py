"""Prompt-lookup (n-gram) drafting that builds a TREE from several matches.

The context (prompt + output so far) is searched for earlier occurrences of its own suffix,
longest suffix first (``max_match`` tokens down to ``min_match``), most recent occurrence
first. The tokens that followed each occurrence are inserted into a trie rooted at the last
committed token, so continuations sharing a prefix share nodes and different continuations
become sibling branches. Insertion stops once the tree holds ``num_draft_tokens`` nodes.

Sources: prompt lookup decoding (A. Saxena, https://github.com/apoorvumang/prompt-lookup-decoding)
for the matching; SGLang's NGRAM speculator (``speculative/ngram_worker.py`` and its C++
``ngram`` cache: match windows tried from the largest down, matches merged into one trie
verified as a draft tree) for the tree.

Why it is the default drafter: on CPU (and for SmolLM2-135M) a draft model's forwards cost a
large fraction of a target forward, while this drafter costs ~10 us per request; structured
output repeats itself (keys, punctuation, values copied from the prompt), so matches are
frequent. See the worker benchmark in the report for the measured numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...tree import DraftTree
from .base import Drafter

__all__ = ["NgramDrafter", "ngram_tree"]


def ngram_tree(
    context: Sequence[int],
    num_draft_tokens: int,
    *,
    max_match: int = 8,
    min_match: int = 1,
    max_depth: int | None = None,
) -> DraftTree:
    """The draft tree for one context.

    Args:
        context: committed token ids (prompt + output), a sequence or an int64 array; the
            last one is the root.
        num_draft_tokens: node cap, root included.
        max_match / min_match: longest and shortest suffix (in tokens) to look up.
        max_depth: longest continuation taken from one match (default ``num_draft_tokens - 1``).

    Returns a :class:`DraftTree` with at most ``num_draft_tokens`` nodes (root only when
    nothing matches). Nodes are inserted in priority order (longer match, then more recent),
    so a trie node's children are ordered by the priority of the match that created them.

    Each earlier occurrence of the last token is one candidate, ranked by how far back its
    match with the context's suffix goes (at most ``max_match``): one pass over the context,
    then at most ``max_match - 1`` passes over the candidates. Dev host, JSON-schema text, 32
    requests: 0.24 ms for all their trees at 0.5-4k tokens of context given as arrays
    (:meth:`RequestState.committed_array`), 0.45-1.7 ms given as lists; a search of the whole
    context per suffix length took 75-150 us a tree at 100-500 tokens (6 ms a step at batch 32
    on the H200 host, 6x the verify forward of SmolLM2-135M).
    """
    ctx = np.asarray(context, dtype=np.int64)
    n_ctx = len(ctx)
    budget = num_draft_tokens - 1
    depth_cap = budget if max_depth is None else max_depth
    tokens = [int(ctx[-1])] if n_ctx else [-1]
    parents = [-1]
    longest = min(max_match, n_ctx - 1)
    if budget <= 0 or depth_cap <= 0 or longest < min_match:
        return DraftTree(tokens, parents)
    # ends p (exclusive) of earlier occurrences of the last token: ctx[p - 1] == ctx[-1], p < n_ctx
    ends = np.flatnonzero(ctx[:-1] == ctx[-1]) + 1
    match = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for k in range(1, longest):  # extend the matches one token further back while they agree
        alive = alive[ends[alive] > k]
        alive = alive[ctx[ends[alive] - 1 - k] == ctx[n_ctx - 1 - k]]
        if not len(alive):
            break
        match[alive] += 1
    keep = match >= min_match
    ends, match = ends[keep], match[keep]
    children: list[dict[int, int]] = [{}]
    for p in ends[np.lexsort((-ends, -match))].tolist():  # longer match first, then more recent
        node = 0
        for t in ctx[p : p + depth_cap].tolist():
            child = children[node].get(t)
            if child is None:
                if budget == 0:
                    break
                child = len(tokens)
                tokens.append(t)
                parents.append(node)
                children.append({})
                children[node][t] = child
                budget -= 1
            node = child
        if budget == 0:
            break
    return DraftTree(tokens, parents)


class NgramDrafter(Drafter):
    """Prompt-lookup draft trees (see the module docstring); stateless, CPU only.

    Args:
        num_draft_tokens: node cap per tree, root included (1 = no drafts).
        max_match / min_match: suffix lengths to look up, tried from the longest.
        max_depth: longest branch (default ``num_draft_tokens - 1``; 1 would give a star).
    """

    name = "ngram"

    def __init__(
        self,
        *,
        num_draft_tokens: int = 8,
        max_match: int = 8,
        min_match: int = 1,
        max_depth: int | None = None,
    ):
        super().__init__(num_draft_tokens=num_draft_tokens)
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match = int(max_match)
        self.min_match = int(min_match)
        self.max_depth = max_depth

    def propose(self, batch) -> list[DraftTree]:
        return [
            ngram_tree(
                s.committed_array(),
                self.num_draft_tokens,
                max_match=self.max_match,
                min_match=self.min_match,
                max_depth=self.max_depth,
            )
            for s in batch
        ]
