"""``SamplingParams``: the per-request sampling settings, in a module of their own (pydantic
only) so that the CLI checks ``--temperature`` and friends before torch loads;
:mod:`~spec_grammar.worker.sampling` re-exports it next to the logits processing."""

from __future__ import annotations

import math

import pydantic

__all__ = ["SamplingParams"]


class SamplingParams(pydantic.BaseModel):
    """Per-request sampling settings (OpenAI / Hugging Face meanings).

    - ``temperature``: 0 = greedy (argmax of the masked logits), else logits are divided by it.
    - ``top_k`` (0 = off) and ``top_p`` (1 = off): Hugging Face ``TopKLogitsWarper`` /
      ``TopPLogitsWarper`` semantics (top-k keeps ties with the k-th value; top-p keeps the
      smallest set of most likely tokens whose mass reaches ``top_p``, at least one token).
    - ``repetition_penalty``: Hugging Face semantics over prompt + output (a seen token's logit
      is divided by it when positive, multiplied when negative).
    - ``frequency_penalty`` / ``presence_penalty``: OpenAI semantics over output tokens only
      (``logit -= frequency * count + presence * (count > 0)``).
    - ``logit_bias``: token id -> value added to the logit.
    - ``seed``: seeds the request's generator (:func:`make_generator`); ``None`` = random; an
      int in ``[-2**63, 2**64)`` (what ``torch.Generator.manual_seed`` takes).
    - The float settings are finite; a ``logit_bias`` value may also be ``-inf`` (a ban).
    - ``max_new_tokens``, ``stop`` (stop strings), ``ignore_eos``, ``logprobs``: read by the loop.
    """

    model_config = pydantic.ConfigDict(extra="forbid")

    # the float settings are finite: inf or NaN would turn every processed row into NaN / -inf
    temperature: float = pydantic.Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = pydantic.Field(0, ge=0)
    # what torch.Generator.manual_seed takes (a larger int fails there, mid-run)
    seed: int | None = pydantic.Field(None, ge=-(2**63), le=2**64 - 1)
    max_new_tokens: int = pydantic.Field(256, ge=0)
    stop: list[str] = []
    ignore_eos: bool = False
    repetition_penalty: float = pydantic.Field(1.0, gt=0.0, allow_inf_nan=False)
    frequency_penalty: float = pydantic.Field(0.0, allow_inf_nan=False)
    presence_penalty: float = pydantic.Field(0.0, allow_inf_nan=False)
    logit_bias: dict[int, float] = {}
    logprobs: bool = False

    @pydantic.field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[int, float]) -> dict[int, float]:
        """A bias is finite or ``-inf`` (the token is banned); NaN or ``+inf`` has no meaning."""
        for tok, bias in value.items():
            if math.isnan(bias) or bias == math.inf:
                raise ValueError(
                    f"logit_bias[{tok}] must be a finite number or -inf (banned), got {bias}"
                )
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
