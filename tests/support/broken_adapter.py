"""A deliberately broken backend: the xgrammar adapter with switchable bugs.

Each bug is one failure kind seen in real grammar integrations (SGLang's tree traversal,
vLLM's rollback history, ...). ``tests/conformance/test_conformance.py`` checks that the conformance suite
catches every one of them and names the right property. Usable from the CLI as well, e.g.
``spec-grammar conformance --backend broken_adapter:ForkSharesState`` with ``tests`` on
``PYTHONPATH``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from spec_grammar_xgrammar import XGrammarBackend, XGrammarMatcher

from spec_grammar.protocol import CompiledGrammar
from spec_grammar.tree import DraftTree

BUGS = {
    "rollback_keeps_termination": "rollback past an accepted EOS leaves the matcher terminated",
    "fork_shares_state": "fork() returns a view of the same library matcher",
    "tree_expands_invalid": "tree fill ignores the parent's row, expands and marks invalid children",
    "tree_stale_rows": "tree fill leaves the rows below rejected nodes as they were",
    "refused_partial": "a refused multi-byte token leaves its legal leading bytes consumed",
    "padding_allowed": "masks allow the padding ids in [tokenizer vocab, logits width)",
    "eos_mid_grammar": "masks allow EOS before the grammar can end",
    "validate_mutates": "validate_tokens accepts the tokens instead of only counting them",
    "row_limit": "after the first token accept refuses what the row allows (a library row limit)",
}
"""Bug name -> what it breaks."""


class BrokenMatcher(XGrammarMatcher):
    """:class:`XGrammarMatcher` with the bugs named in ``bugs`` switched on."""

    def __init__(self, backend: BrokenBackend, matcher: Any):
        super().__init__(backend, matcher)
        self.bugs = backend.bugs
        self._ended = False

    def _accept_token(self, token: int) -> bool:
        if "row_limit" in self.bugs and self.num_accepted >= 1:
            return False
        ok = super()._accept_token(token)
        if ok and self.is_stop_token(token):
            self._ended = True
        if not ok and "refused_partial" in self.bugs:
            for byte in self.info.token_bytes[token]:
                if not self._m.accept_string(bytes([byte])):
                    break
        return ok

    def _is_terminated(self) -> bool:
        if "rollback_keeps_termination" in self.bugs and self._ended:
            return True
        return super()._is_terminated()

    def _fork(self) -> BrokenMatcher:
        twin = BrokenMatcher(
            self._backend, self._m if "fork_shares_state" in self.bugs else self._m.fork()
        )
        twin._ended = self._ended
        return twin

    def _validate_tokens(self, tokens: list[int]) -> int:
        if "validate_mutates" in self.bugs:
            return self._accept_tokens(tokens)
        return super()._validate_tokens(tokens)

    def _fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        super()._fill_next_token_bitmask(bitmask, row)
        if "eos_mid_grammar" in self.bugs:
            for t in self.info.stop_token_ids:
                bitmask[row, t // 32] |= 1 << (t % 32)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        super().fill_next_token_bitmask(bitmask, row)
        if "padding_allowed" in self.bugs:
            _set_padding_bits(bitmask, row, self.info.tokenizer_vocab_size, self.info.vocab_size)

    def _fill_tree_bitmask(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        if "tree_stale_rows" in self.bugs:
            safe = tree.tokens.clamp(0, self.info.tokenizer_vocab_size - 1)
            # xgrammar's native walk alone (gotcha G8: descendants of rejected nodes keep stale rows)
            links = np.array(
                (tree.first_child_list, tree.next_sibling_list, safe.tolist()), dtype=np.int64
            )
            words = self._traverse(tree, links, bitmask, row_offset)
            return torch.tensor(
                [
                    i == 0 or bool((int(words[p, t >> 5]) >> (t & 31)) & 1)
                    for i, (p, t) in enumerate(zip(tree.parent_list, safe.tolist()))
                ],
                dtype=torch.bool,
            )
        if "tree_expands_invalid" in self.bugs:
            return self._expand_everything(tree, bitmask, row_offset)
        return super()._fill_tree_bitmask(tree, bitmask, row_offset)

    def _expand_everything(
        self, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> torch.Tensor:
        # Trusts accept instead of the parent's row, and on a refusal still fills the child's
        # row (from the parent's state) and walks its subtree.
        valid = [True] * tree.num_nodes

        def visit(node: int) -> None:
            self._fill_next_token_bitmask(bitmask, row_offset + node)
            for child in tree.children(node):
                t = tree.token_list[child]
                took = 0 <= t < self.info.tokenizer_vocab_size and self._accept_token(t)
                if not took or not self._is_terminated():
                    visit(child)
                if took:
                    self._rollback(1)

        visit(0)
        return torch.tensor(valid, dtype=torch.bool)


def _set_padding_bits(bitmask: torch.Tensor, row: int, start: int, stop: int) -> None:
    for t in range(start, stop):
        word = int(bitmask[row, t // 32]) | (1 << (t % 32))
        bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word


class BrokenBackend(XGrammarBackend):
    """The xgrammar backend whose matchers carry ``bugs`` (a subset of :data:`BUGS`)."""

    name = "broken-xgrammar"
    bugs: frozenset[str] = frozenset()

    def __init__(self, tokenizer: Any, *, bugs: Iterable[str] | None = None, **kwargs: Any):
        super().__init__(tokenizer, **kwargs)
        if bugs is not None:
            unknown = set(bugs) - set(BUGS)
            if unknown:
                raise ValueError(f"unknown bugs {sorted(unknown)}; known: {sorted(BUGS)}")
            self.bugs = frozenset(bugs)

    def _matcher(self, compiled: CompiledGrammar) -> BrokenMatcher:
        import xgrammar as xgr

        return BrokenMatcher(self, xgr.GrammarMatcher(compiled.native))


def backend_with(bug: str) -> type[BrokenBackend]:
    """A :class:`BrokenBackend` subclass with one bug, named after it in CamelCase (also a
    module attribute, so ``broken_adapter:ForkSharesState`` loads it)."""
    return globals()[_class_name(bug)]


def _class_name(bug: str) -> str:
    return "".join(part.capitalize() for part in bug.split("_"))


for _bug in BUGS:
    globals()[_class_name(_bug)] = type(
        _class_name(_bug), (BrokenBackend,), {"bugs": frozenset([_bug])}
    )
