"""``WorkerConfig``: the one list of options of the speculative worker.

:class:`~spec_grammar.worker.engine.SpecWorker` takes one; :func:`~spec_grammar.worker.api.build_worker`
and :func:`~spec_grammar.worker.api.generate` take its fields as keyword arguments (or a
``config=``), so every option, its default and its check is written here once. What to load
(model, grammar backend, device, dtype) stays with :func:`~spec_grammar.worker.api.build_worker`,
and per-request sampling with :class:`~spec_grammar.worker.sampling.SamplingParams`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .drafters import DEFAULT_DRAFT, Drafter
from .drafters.constrained import DEFAULT_FORCED_TOKENS
from .runner import check_optional_flag

__all__ = ["WorkerConfig", "worker_config"]


class WorkerConfig(BaseModel):
    """How a :class:`~spec_grammar.worker.engine.SpecWorker` drafts, verifies and places its
    grammar work. Immutable; no option changes outputs except through the drafter (and then
    only speed: every draft token is verified), and temperature-0 outputs never depend on it.

    Raises the errors the options always raised, with their messages: ``ValueError`` for a bad
    ``grammar_threads`` / ``lazy_grammar`` or a drafter name of no known form (``self:x``),
    :class:`~spec_grammar.worker.runner.RunnerError` for a bad ``cuda_graphs`` /
    ``fused_forward``; a value of the wrong type gets pydantic's ``ValidationError`` (a
    ``ValueError``), and so does a tree shape (``topk``, ``num_steps``, ``num_draft_tokens``)
    that is not an int >= 1 (a bool, ``"3"`` or ``3.0`` is no count).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    draft: str | Drafter | None = Field(
        DEFAULT_DRAFT,
        description="The drafter: ``ngram`` (prompt lookup), ``self:L`` (the target's first L "
        "layers), ``model:PATH`` (a smaller model sharing the tokenizer), ``grammar`` "
        "(grammar-forced tokens alone), ``none``/None (no drafts), or a "
        ":class:`~spec_grammar.worker.drafters.Drafter` used as given "
        "(:func:`~spec_grammar.worker.drafters.constrained.make_grammar_drafter`).",
    )
    topk: int = Field(
        1,
        strict=True,
        ge=1,
        description="Draft-tree branches per expanded node and frontier width, model drafters "
        "only (1 = a chain).",
    )
    num_steps: int = Field(
        4,
        strict=True,
        ge=1,
        description="Draft depth: draft forwards per step, model drafters only.",
    )
    num_draft_tokens: int = Field(
        8,
        strict=True,
        ge=1,
        description="Node cap of a draft tree, root included (SGLang's "
        "``speculative_num_draft_tokens``); the n-gram drafter uses this alone.",
    )
    constrain_draft: bool = Field(
        False,
        strict=True,
        description="Grammar-constrained drafting: only legal tokens enter the tree and the rows "
        "computed while drafting are reused for verification "
        "(:mod:`~spec_grammar.worker.drafters.constrained`).",
    )
    forced_tokens: bool = Field(
        DEFAULT_FORCED_TOKENS,
        strict=True,
        description="Extend draft branches with grammar-forced tokens "
        "(:mod:`~spec_grammar.worker.drafters.forced`); default "
        ":data:`~spec_grammar.worker.defaults.DEFAULT_FORCED_TOKENS`. A "
        "``SpecWorker`` built without a config defaults it to False, so that a Drafter instance "
        "passed in runs exactly as given.",
    )
    no_spec: bool = Field(
        False,
        strict=True,
        description="Plain constrained decoding (root-only trees) through the same code path.",
    )
    draft_budget: bool = Field(
        True,
        strict=True,
        description="Cut each step's draft trees to the nodes that maximise expected committed "
        "tokens per second, from each request's measured acceptance and a measured cost model "
        "of the step by forward rows (:mod:`~spec_grammar.worker.draft_budget`; a request may "
        "get no drafts at all). False: verify every proposed node. Greedy outputs do not "
        "depend on it.",
    )
    overlap: bool = Field(
        True,
        strict=True,
        description="Do the grammar work while the verify forward runs (in the grammar thread; "
        "with CUDA graphs inline after the replay or in the thread during it, as measured "
        "fastest: :class:`~spec_grammar.worker.placement.GrammarPlacement`). False: strictly in "
        "order (on CUDA the forward is waited for first).",
    )
    grammar_threads: int | None = Field(
        None,
        description="Threads sharing a step's grammar work (advance + tree fill), each taking a "
        "contiguous group of requests; None = 1. Outputs do not depend on it. More threads pay "
        "only where the backend's GIL-free native work dominates a fill: with xgrammar on a "
        "16-core H200 host, 8 threads were up to 2.5x slower than one for 8-16-node trees (7.1 "
        "vs 2.8 ms at 8 requests x 8 nodes) and a second thread was 0.76x on 2 cores "
        "(``benchmarks/results/grammar-threads-h200.md``). An int >= 1 or None.",
    )
    lazy_grammar: bool | None = Field(
        None,
        description="Verify greedy grammar requests lazily, without tree fills (each walk asks "
        "the matcher for the greedy tokens it reads: "
        ":class:`~spec_grammar.worker.placement.LazyGrammar`). None: on CUDA-graph steps with "
        "overlap whenever the measured fill time would not hide under the forward; True: always; "
        "False: never. Outputs do not depend on it.",
    )
    cuda_graphs: bool | None = Field(
        None,
        description="Replay CUDA graphs for full-batch forwards (CUDA devices only; None = on "
        "there): :class:`~spec_grammar.worker.runner.ModelRunner`'s option, for the target's "
        "runner and a draft model's.",
    )
    fused_forward: bool | None = Field(
        None,
        description="Our fused decoder instead of the model's HF forward "
        "(:mod:`~spec_grammar.worker.decoder`, Llama-family models; None = on for CUDA with "
        "Triton where supported): :class:`~spec_grammar.worker.runner.ModelRunner`'s option.",
    )

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as e:
            # an option check below raised: that error, as the worker always raised it
            own = [err["ctx"]["error"] for err in e.errors() if "error" in err.get("ctx", {})]
            if own:
                raise own[0] from None
            raise

    @field_validator("draft")
    @classmethod
    def _check_draft(cls, value: Any) -> Any:
        # the form of a drafter name, checked before any model loads (the layer count and the
        # path are checked when the drafter is built)
        if isinstance(value, str) and value not in ("ngram", "grammar", "none"):
            kind, _, arg = value.partition(":")
            if kind not in ("self", "model") or not arg:
                raise ValueError(
                    f"unknown drafter {value!r}: use ngram, self:L, model:PATH, grammar or none"
                )
            if kind == "self":
                try:
                    int(arg)
                except ValueError:
                    raise ValueError(f"self:L needs an integer layer count, got {arg!r}") from None
        return value

    @field_validator("grammar_threads", mode="before")
    @classmethod
    def _check_grammar_threads(cls, value: Any) -> Any:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"grammar_threads must be None or an int >= 1, got {value!r}")
        return value

    @field_validator("lazy_grammar", mode="before")
    @classmethod
    def _check_lazy_grammar(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"lazy_grammar must be None, True or False, got {value!r}")
        return value

    @field_validator("cuda_graphs", "fused_forward", mode="before")
    @classmethod
    def _check_runner_flag(cls, value: Any, info: ValidationInfo) -> Any:
        return check_optional_flag(info.field_name, value)


def worker_config(
    config: WorkerConfig | None, options: dict[str, Any], caller: str
) -> WorkerConfig:
    """``config`` with ``options`` (WorkerConfig fields) applied, or a config of ``options``
    alone. Raises ``TypeError`` naming ``caller`` for a keyword that is no option (what a
    signature listing the options raised) and the option errors of :class:`WorkerConfig`."""
    unknown = [name for name in options if name not in WorkerConfig.model_fields]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if config is None:
        return WorkerConfig(**options)
    if not isinstance(config, WorkerConfig):
        raise TypeError(f"config must be a WorkerConfig, got {type(config).__name__}")
    return WorkerConfig(**{**dict(config), **options}) if options else config
