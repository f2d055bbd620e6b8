"""The grammar half of our vLLM drafters (0.32's proposer, 0.34's speculator): per request, a
matcher holding exactly the committed output tokens, and the draft it gives for an n-gram
draft (the longest legal prefix, then the grammar-forced tokens after it: jump-forward as
drafts, :mod:`spec_grammar.worker.drafters.forced`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spec_grammar.protocol import SpecGrammar
from spec_grammar.tree import DraftTree
from spec_grammar.worker.drafters.forced import extend_with_forced, walk_tree

__all__ = ["RequestGrammar", "grammar_draft"]


@dataclass
class RequestGrammar:
    """One request's grammar state in a drafter: ``matcher`` has accepted exactly
    ``committed`` (the request's output tokens so far, committed by the verifier). ``key``
    names the constraint the matcher was made for (a new one means a rebuild)."""

    key: Any
    matcher: SpecGrammar
    committed: list[int]

    def advance(self, output: np.ndarray) -> bool:
        """Bring the matcher to the committed ``output`` (``(n,)`` int token ids): accept the
        tokens after the replayed prefix. Returns False when ``output`` does not extend the
        replayed prefix (the caller rebuilds) or the matcher refuses a committed token (after
        termination, tokens are ignored as the engine does)."""
        n = len(self.committed)
        if len(output) < n or output[:n].tolist() != self.committed:
            return False
        new = output[n:].tolist()
        if new and not self.matcher.is_terminated():
            ok = self.matcher.accept_tokens(new)
            if ok != len(new) and not self.matcher.is_terminated():
                return False
        self.committed.extend(new)
        return True


def grammar_draft(matcher: SpecGrammar, last: int, ngram: list[int], k: int) -> list[int]:
    """Up to ``k`` draft tokens after the committed tokens (the last one ``last``): the longest
    prefix of ``ngram`` that ``matcher`` accepts, then the grammar-forced tokens after it.
    ``matcher`` is left as it was."""
    if matcher.is_terminated() or k <= 0:
        return []
    draft = walk_tree(matcher, DraftTree.chain(last, ngram[:k]), k, fill_rows=False)

    def leaf_matcher(node: int) -> SpecGrammar:
        m = matcher.fork()
        m.accept_tokens(draft.path(node))
        return m

    extend_with_forced(draft, leaf_matcher, k)
    return draft.tokens[1:]  # a chain: node order is path order
