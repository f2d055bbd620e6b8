"""The drafter interface: one draft tree per request per step.

A drafter proposes; the target verifies. Drafts need not respect the grammar: invalid nodes
are never accepted (the tree bitmask marks them), so a drafter only affects speed, never
output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...errors import SpecGrammarError
from ...tree import DraftTree

if TYPE_CHECKING:
    from ..request import RequestState

__all__ = ["Drafter", "NoDrafter"]


class Drafter:
    """Proposes draft trees.

    ``propose(batch)`` returns one :class:`~spec_grammar.tree.DraftTree` per request, in
    order, whose root (node 0) is the request's last committed token and which has at most
    ``num_draft_tokens`` nodes, root included (SGLang's ``speculative_num_draft_tokens``
    convention). Drafters holding per-request state (a KV cache) override :meth:`add` /
    :meth:`remove`; the worker calls them when a request starts and when it ends.

    What a drafter can do beyond proposing is declared here, with the plain defaults:
    :attr:`needs_grammar_state` and :meth:`draft_rows` (the grammar-aware drafter,
    :class:`~.constrained.GrammarAwareDrafter`, sets both).
    """

    name = "base"
    needs_grammar_state: bool = False
    """True: the worker feeds every matcher the committed tokens before :meth:`propose` (the
    drafter reads the grammar state after them), not under the verify forward."""

    def __init__(self, *, num_draft_tokens: int = 8):
        if num_draft_tokens < 1:
            raise ValueError(
                f"num_draft_tokens must be >= 1 (the root counts), got {num_draft_tokens}"
            )
        self.num_draft_tokens = int(num_draft_tokens)

    def add(self, state: RequestState) -> None:
        """A request joins the batch (its prompt is known, nothing generated yet)."""

    def add_batch(self, states: Sequence[RequestState]) -> dict[str, SpecGrammarError]:
        """Several requests join at once (the worker's way at the start of a run); returns the
        ones refused, by id (:meth:`add` raised a :class:`SpecGrammarError` for them)."""
        refused: dict[str, SpecGrammarError] = {}
        for st in states:
            try:
                self.add(st)
            except SpecGrammarError as e:
                refused[st.rid] = e
        return refused

    def remove(self, rid: str) -> None:
        """A request left the batch; drop its state."""

    def propose(self, batch: Sequence[RequestState]) -> list[DraftTree]:  # pragma: no cover
        raise NotImplementedError

    def draft_rows(self, rid: str, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verification rows of request ``rid``'s ``tree`` computed while drafting it:
        ``(bitmask (N, W) int32, valid (N,) bool)``, which the worker then uses instead of a
        tree fill; ``tree`` may be the proposed tree cut to a smaller depth. None (this
        default): no rows kept, the worker fills the tree."""
        return None


class NoDrafter(Drafter):
    """Root-only trees: plain (non-speculative) decoding through the speculative code path."""

    name = "none"

    def __init__(self) -> None:
        super().__init__(num_draft_tokens=1)

    def propose(self, batch: Sequence[RequestState]) -> list[DraftTree]:
        return [DraftTree.chain(s.root_token, []) for s in batch]
