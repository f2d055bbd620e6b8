"""Drafters behind one interface (:class:`Drafter`), chosen by a short name:

- ``ngram`` (default): prompt-lookup trees, :class:`NgramDrafter`;
- ``self:L``: the target's first ``L`` layers as draft model, :class:`ModelDrafter`;
- ``model:PATH``: a smaller causal LM sharing the tokenizer, :class:`ModelDrafter`;
- ``none``: no drafts (plain decoding through the speculative path), :class:`NoDrafter`.
"""

from __future__ import annotations

from typing import Any

from .base import Drafter, NoDrafter
from .model import ModelDrafter, truncated_model
from .ngram import NgramDrafter, ngram_tree

__all__ = [
    "Drafter",
    "NoDrafter",
    "NgramDrafter",
    "ModelDrafter",
    "make_drafter",
    "ngram_tree",
    "truncated_model",
    "DEFAULT_DRAFT",
]

DEFAULT_DRAFT = "ngram"


def make_drafter(
    draft: str | Drafter | None,
    *,
    target_model: Any = None,
    device: Any = None,
    cuda_graphs: bool | None = None,
    fused_forward: bool | None = None,
    topk: int = 1,
    num_steps: int = 4,
    num_draft_tokens: int = 8,
) -> Drafter:
    """Build the drafter named by ``draft`` (see the module docstring); a :class:`Drafter`
    instance is returned as is.

    ``target_model`` is needed by ``self:L`` (its layers are shared). The draft model of
    ``model:PATH`` is loaded with the target's dtype. ``cuda_graphs`` / ``fused_forward``: the
    draft model's :class:`~spec_grammar.worker.runner.ModelRunner` settings (the worker passes
    its own). Raises ``ValueError`` naming the accepted
    forms on an unknown name, and :class:`~spec_grammar.models.ModelNotFoundError` when the
    path does not exist.
    """
    if isinstance(draft, Drafter):
        return draft
    if draft is None or draft == "none":
        return NoDrafter()
    if draft == "ngram":
        return NgramDrafter(num_draft_tokens=num_draft_tokens)
    kind, _, arg = draft.partition(":")
    if kind not in ("self", "model") or not arg:
        raise ValueError(
            f"unknown drafter {draft!r}: use ngram, self:L, model:PATH, grammar or none"
        )
    from ..runner import ModelRunner

    if kind == "self":
        if target_model is None:
            raise ValueError("self:L drafting needs the target model")
        try:
            layers = int(arg)
        except ValueError:
            raise ValueError(f"self:L needs an integer layer count, got {arg!r}") from None
        draft_model = truncated_model(target_model, layers)
    else:
        from ...models import load_model

        dtype = next(target_model.parameters()).dtype if target_model is not None else None
        draft_model = load_model(arg, dtype=dtype)
    vocab_limit = target_model.config.vocab_size if target_model is not None else None
    return ModelDrafter(
        ModelRunner(
            draft_model, device=device, cuda_graphs=cuda_graphs, fused_forward=fused_forward
        ),
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=num_draft_tokens,
        vocab_limit=vocab_limit,
    )
