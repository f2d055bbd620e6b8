"""Requests, their per-step state inside :class:`~spec_grammar.worker.engine.SpecWorker`, and
the statistics a run reports.

Conventions (``WORKER_INTERFACES.md``): a request's committed sequence is ``prompt_ids +
output_ids``; its last token is the root of the next draft tree.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ValidationError

from ..errors import SpecGrammarError
from ..output_check import Violation
from ..specs import GrammarSpec, ToolCalls, as_grammar_spec
from .sampling import SamplingParams

__all__ = [
    "Request",
    "RequestState",
    "RequestResult",
    "StepStats",
    "FinishReason",
    "FinishDetail",
    "COMPLETED_DETAILS",
    "Violation",
    "finish_reason_of",
    "RequestError",
    "check_request",
]

FinishReason = Literal["stop", "length", "tool_calls", "error", "cancelled"]
"""Why a request ended, in OpenAI's chat-completion vocabulary: ``stop`` = a stop token (a
grammar's document complete, or EOS without a grammar) or a stop string; ``length`` =
``max_new_tokens`` (a grammar-constrained output is then incomplete); ``tool_calls`` = a
:class:`~spec_grammar.specs.ToolCalls` grammar completed its calls. Two values OpenAI does not
have: ``error`` (the request failed: see ``error``) and ``cancelled``
(:meth:`SpecWorker.cancel`). The finer reason is :data:`FinishDetail`."""

FinishDetail = Literal["eos", "stop_string", "grammar", "violation", "length", "error", "cancelled"]
"""The worker's own reason a request ended: ``eos`` = a stop token without grammar;
``stop_string`` = a stop string; ``grammar`` = the grammar accepted a stop token (the document
is complete); ``violation`` = the output ended (as ``grammar``, ``eos`` or ``stop_string``)
but breaks its request as written (:attr:`RequestResult.violations`: a keyword the backend
does not enforce, a stop string cutting a document); ``length`` = ``max_new_tokens``;
``error`` = the grammar failed to compile or a matcher refused a committed token;
``cancelled`` = :meth:`SpecWorker.cancel` was called."""

COMPLETED_DETAILS = frozenset({"eos", "stop_string", "grammar"})
"""The finish details whose output is *completed*, and so post-checked
(:mod:`spec_grammar.output_check`): the output ended by itself or at a stop string. An output
cut at ``max_new_tokens`` (``length``) is unfinished: its ``valid`` is None and
``finish_reason="length"`` says it (the CLI exits with its own code); one that errored or was
cancelled has no output to check."""


def finish_reason_of(
    detail: FinishDetail, grammar: GrammarSpec | None, text: str = ""
) -> FinishReason:
    """The OpenAI ``finish_reason`` of a request that ended for ``detail`` under ``grammar``
    with output ``text``: ``tool_calls`` when a tool-call grammar completed with calls (a
    tagged-format output without any call is a text answer: ``stop``)."""
    if detail in ("eos", "stop_string"):
        return "stop"
    if detail in ("grammar", "violation"):
        if isinstance(grammar, ToolCalls) and (
            grammar.call_format == "json_array" or grammar.call_open in text
        ):
            return "tool_calls"
        return "stop"
    return detail


_ids = itertools.count()


@dataclass
class Request:
    """One generation request.

    Attributes:
        prompt: the full prompt text (chat template already applied) or its token ids.
        grammar: the constraint (a spec, a JSON-schema dict or a pydantic model class), or
            None for plain decoding.
        sampling: a :class:`~spec_grammar.worker.sampling.SamplingParams` (None = defaults).
        rid: a unique id (one is made up when None).
        reasoning_end: the reasoning end marker (text such as ``"</think>"``, or token ids):
            output up to and including it is free text, the grammar applies after it
            (:class:`~spec_grammar.reasoning.ReasoningGrammar`); the result's ``text`` is then
            the part after the marker and ``reasoning_text`` the part before it. None: the
            grammar applies from the first token.
        max_reasoning_tokens: with ``reasoning_end``, the reasoning budget: after that many
            tokens without the marker, the marker is forced.
    """

    prompt: str | list[int]
    grammar: GrammarSpec | None = None
    sampling: Any = None
    rid: str | None = None
    reasoning_end: str | list[int] | None = None
    max_reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.rid is None:
            self.rid = f"req-{next(_ids)}"


class RequestError(SpecGrammarError, ValueError):
    """A :class:`Request` field has the wrong type or value; the worker ends that request with
    ``finish_reason="error"`` and runs the others."""


def one_line(e: ValidationError) -> str:
    """A pydantic validation error as one line: ``field: message; ...``."""
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors()
    )


def check_request(req: Request) -> SamplingParams:
    """Check ``req``'s fields and return its sampling params (defaults for None, a dict
    converted; a JSON-schema dict or pydantic model class as ``grammar`` is replaced by its
    :class:`~spec_grammar.specs.JsonSchema`). Raises :class:`RequestError` naming the field: a
    prompt that is neither text nor a list of ints (numpy integers count; bools do not), a
    grammar that is none of these or not a valid schema, bad sampling values, an id that is not a string
    (its :class:`RequestResult` could not carry it)."""
    if not isinstance(req.rid, str):
        raise RequestError(f"request id must be a string, got {type(req.rid).__name__} {req.rid!r}")
    if not isinstance(req.prompt, (str, list, tuple)):
        raise RequestError(
            f"request {req.rid}: prompt must be text or a list of token ids, got {type(req.prompt).__name__}"
        )
    if not isinstance(req.prompt, str):
        bad = [
            t
            for t in req.prompt
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
        ]
        if bad:
            raise RequestError(f"request {req.rid}: prompt token ids must be ints, got {bad[0]!r}")
    try:  # a schema dict or pydantic model class becomes its JsonSchema here
        req.grammar = as_grammar_spec(req.grammar)
    except (TypeError, ValueError) as e:
        raise RequestError(f"request {req.rid}: {e}") from None
    _check_reasoning(req)
    if req.sampling is None or isinstance(req.sampling, SamplingParams):
        return req.sampling or SamplingParams()
    if not isinstance(req.sampling, dict):
        raise RequestError(
            f"request {req.rid}: sampling must be SamplingParams, a dict or None, got {type(req.sampling).__name__}"
        )
    try:
        return SamplingParams(**req.sampling)
    except ValidationError as e:
        raise RequestError(f"request {req.rid}: bad sampling: {one_line(e)}") from None


def _check_reasoning(req: Request) -> None:
    end, budget = req.reasoning_end, req.max_reasoning_tokens
    if end is not None:
        ids_ok = isinstance(end, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in end
        )
        if not (isinstance(end, str) or ids_ok) or not end:
            raise RequestError(
                f"request {req.rid}: reasoning_end must be non-empty text or a list of token ids, "
                f"got {end!r:.60}"
            )
    if budget is not None:
        if end is None:
            raise RequestError(f"request {req.rid}: max_reasoning_tokens needs reasoning_end")
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise RequestError(
                f"request {req.rid}: max_reasoning_tokens must be an int >= 0, got {budget!r:.40}"
            )


@dataclass(eq=False)
class RequestState:
    """What the worker and the drafters know about a request while it runs.

    Attributes:
        request: the request.
        prompt_ids: prompt token ids (at least one).
        output_ids: committed output ids (stop token excluded).
        matcher: the request's :class:`~spec_grammar.protocol.SpecGrammar` (None without grammar).
        pending: committed tokens the matcher has not been fed yet (fed at the start of the
            next step's grammar work, exactly once).
        steps: target verify forwards this request took part in.
    """

    request: Request
    prompt_ids: list[int]
    sampling: Any
    output_ids: list[int] = field(default_factory=list)
    matcher: Any = None
    pending: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishDetail | None = None
    error: str | None = None
    steps: int = 0
    generator: Any = None
    start_s: float = 0.0
    end_s: float = 0.0
    grammar_ms: float = 0.0
    grammar_exposed_ms: float = 0.0
    warnings: tuple[str, ...] = ()
    backend_name: str | None = None
    backend_reason: str | None = None
    _context: Any = field(
        default=None, init=False, repr=False
    )  # committed ids, int64, grown in place
    _context_len: int = field(default=0, init=False, repr=False)

    @property
    def rid(self) -> str:
        return self.request.rid  # type: ignore[return-value]

    @property
    def committed_ids(self) -> list[int]:
        """``prompt_ids + output_ids``: the context the next draft tree continues."""
        return self.prompt_ids + self.output_ids

    def committed_array(self) -> np.ndarray:
        """:attr:`committed_ids` as an int64 array ``(len,)``: a view of a buffer kept with
        the request and extended by the tokens committed since the last call (prompt and
        output only grow), valid until the next call. The n-gram drafter reads it every step;
        converting the list each time cost 5-50 us at 0.5-4k tokens."""
        n_prompt = len(self.prompt_ids)
        n = n_prompt + len(self.output_ids)
        buf, done = self._context, self._context_len
        if buf is None or buf.size < n:
            grown = np.empty(max(64, 2 * n), dtype=np.int64)
            if buf is not None:
                grown[:done] = buf[:done]
            buf = self._context = grown
        if done < n_prompt:
            buf[done:n_prompt] = self.prompt_ids[done:]
            done = n_prompt
        if done < n:
            buf[done:n] = self.output_ids[done - n_prompt :]
        self._context_len = n
        return buf[:n]

    @property
    def root_token(self) -> int:
        """The last committed token (node 0 of the next draft tree)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def finish(self, reason: FinishDetail, end_s: float, error: str | None = None) -> None:
        self.finished = True
        self.finish_reason = reason
        self.error = error
        self.end_s = end_s


class RequestResult(BaseModel):
    """One request's output and statistics (what ``generate`` returns, ``--json`` prints).

    ``accept_length`` = output tokens per target verify forward (1.0 without speculation);
    ``tokens_per_s`` = output tokens over the request's wall time (seconds, worker start to
    finish); grammar times are the request's total milliseconds of matcher work (advance + tree
    fill, over all its steps and the advance by its last tokens after the last step), split into
    the part hidden under the verify forward and the part the loop waited for.
    """

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    reasoning_text: str | None = None
    """With ``reasoning_end``: the output before the marker (``text`` is the part after it);
    the whole output when the marker never came."""
    tool_calls: list[dict[str, Any]] | None = None
    """A tool-call grammar's calls once it completed, each ``{"name", "arguments"}``."""
    content: str | None = None
    """With ``tool_calls``: the text around the calls (tagged format), None for a JSON array."""
    finish_reason: FinishReason
    finish_detail: FinishDetail
    """The worker's finer reason (:data:`FinishDetail`): ``grammar`` (document complete),
    ``eos``, ``stop_string``, ``length``, ``error``, ``cancelled``."""
    error: str | None = None
    num_tokens: int
    steps: int
    accept_length: float
    tokens_per_s: float
    grammar_ms_hidden: float
    grammar_ms_exposed: float
    warnings: list[str] = []
    """About this request, one line each: JSON-Schema keyword uses (and output limits the
    schema reaches) the grammar backend compiled but does not enforce; a ``max_new_tokens``
    clamped to the model's context."""
    valid: bool | None = None
    """Whether the output is valid under its request as written (the user's schema, tool list
    or regex, checked by :func:`~spec_grammar.output_check.check_output`, not by the grammar
    that produced it). None where no check applies: no grammar, EBNF / Lark (no oracle but
    the grammar itself), an output not completed (:data:`COMPLETED_DETAILS`: cut at
    ``max_new_tokens``, an error, cancelled)."""
    violations: list[Violation] = []
    """With ``valid=False``: where and how the output breaks its request (JSON pointers into
    the output, ``jsonschema``'s messages)."""
    backend: str | None = None
    """The grammar backend that served the request (with ``auto``, the one it chose)."""
    backend_reason: str | None = None
    """With ``auto``: why that backend (:mod:`spec_grammar.routing`)."""

    @classmethod
    def failed_before_run(cls, rid: Any, why: str) -> RequestResult:
        """The result of a request that failed before any model work (a bad batch line, a
        grammar refused at compile): ``finish_reason="error"``, no tokens, ``error=why``."""
        return cls(
            rid=rid if isinstance(rid, str) else repr(rid),
            text="",
            token_ids=[],
            prompt_tokens=0,
            finish_reason="error",
            finish_detail="error",
            error=why,
            num_tokens=0,
            steps=0,
            accept_length=0.0,
            tokens_per_s=0.0,
            grammar_ms_hidden=0.0,
            grammar_ms_exposed=0.0,
        )

    def message(self) -> dict[str, Any]:
        """The output as an OpenAI chat-completion message: ``{"role": "assistant",
        "content": text}``; when a tool-call grammar completed with calls (``finish_reason ==
        "tool_calls"``), ``content`` = the text around the calls (None for a JSON array) and
        ``tool_calls`` = ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
        with the arguments as JSON text, as OpenAI returns them; with a reasoning marker, the
        reasoning in ``reasoning_content`` (vLLM's and DeepSeek's field)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning_text is not None:
            msg["reasoning_content"] = self.reasoning_text
        if self.tool_calls:
            msg["content"] = self.content
            msg["tool_calls"] = [
                {
                    "id": f"call_{self.rid}_{i}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(call["arguments"], ensure_ascii=False),
                    },
                }
                for i, call in enumerate(self.tool_calls)
            ]
        return msg


class StepStats(BaseModel):
    """One worker step, milliseconds of wall time.

    ``step_ms`` is the whole step; ``grammar_ms`` is the matcher work (advance with the
    previous step's tokens + tree bitmask fill, or for lazily verified requests the first
    branch pre-accepted + the walks' accepts and row fills after the forward);
    ``grammar_exposed_ms`` is the part of it that made the step longer than the verify forward
    alone (all of it with ``overlap=False``; a lazy walk's part after the forward always).
    The other parts are phases of the calling thread and need not add up to ``step_ms``: with
    overlap the grammar work runs in a worker thread while the GPU computes, so the later wait
    for the logits (in ``sample_ms``) is shorter by the hidden part.
    """

    batch_size: int
    num_nodes: int
    step_ms: float
    draft_ms: float
    verify_forward_ms: float
    grammar_ms: float
    grammar_exposed_ms: float
    sample_ms: float
    committed_tokens: int
    grammar_in_thread: bool = False
    """With CUDA graphs and overlap: the grammar work ran in the grammar thread (started before
    the replay) rather than inline after it (:mod:`~spec_grammar.worker.placement`)."""
    forbidden_rows: int = 0
    """Rows the greedy walks visited whose grammar forbids the forward's greedy token (each
    masked on the device: :mod:`~spec_grammar.worker.batch_verify`)."""
    early_mask: bool = False
    """Every grammar row was masked on the device while the forward ran
    (:class:`~spec_grammar.worker.placement.EarlyMask`) rather than on demand after it."""
    proposed_nodes: int = 0
    """Draft-tree nodes the drafter proposed (roots included; a request the draft budget did
    not draft counts its root), before the draft budget
    (:mod:`~spec_grammar.worker.draft_budget`) cut them to ``num_nodes``."""
    forward_rows: int = 0
    """Rows the verify forward's projections computed (the first of
    :meth:`~spec_grammar.worker.runner.ModelRunner.forward_shape`)."""
    predicted_ms: float | None = None
    """The draft budget's predicted milliseconds of the whole step, drafting included
    (``step_ms`` measured); None without a budget or before its first measurement."""
    lazy_requests: int = 0
    """Greedy grammar requests verified lazily: no tree fill, their matchers asked for the
    greedy tokens their walks read (:class:`~spec_grammar.worker.placement.LazyGrammar`)."""
