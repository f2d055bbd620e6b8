"""``generate``: the one-call entry point of the speculative worker, and prompt building.

Example::

    from spec_grammar import JsonSchema
    from spec_grammar.worker import generate, schema_prompt

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    [out] = generate([schema_prompt(schema, "Invent a user.")], grammar=JsonSchema(schema))
    print(out.text, out.finish_reason, out.accept_length)
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel

from ..specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, ToolCalls
from .config import WorkerConfig, worker_config
from .engine import SpecWorker
from .request import Request, RequestResult, StepStats
from .sampling import SamplingParams

__all__ = [
    "generate",
    "build_worker",
    "build_prompt",
    "schema_prompt",
    "resolve_device",
    "precompile",
    "summarize",
    "RunSummary",
]

_lock = threading.Lock()
_models: dict[tuple, tuple[Any, Any]] = {}
_backends: dict[tuple, Any] = {}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"`` (or None) = CUDA when available, else CPU; anything else as given."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available here (use cpu or auto)")
    return dev


def _load(model: str, dtype: Any, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer), cached per (name, dtype, device) for the process."""
    from ..models import load_model, load_tokenizer

    key = (model, str(dtype), str(device))
    with _lock:
        if key not in _models:
            _models[key] = (load_model(model, dtype=dtype, device=device), load_tokenizer(model))
        return _models[key]


def _backend(name: str, model: str, tokenizer: Any, vocab_size: int) -> Any:
    """The grammar backend ``name`` for ``model``'s tokenizer, cached (it keeps the compile cache)."""
    from ..registry import get_backend

    key = (name, model, vocab_size)
    with _lock:
        if key not in _backends:
            _backends[key] = get_backend(name, tokenizer, vocab_size=vocab_size)
        return _backends[key]


def _config_vocab_size(model: str) -> int | None:
    """The logits width in ``model``'s saved config (no weights loaded); None when no config
    is on disk yet (a GGUF model before its first load)."""
    from transformers import AutoConfig

    from ..models import _resolve

    src, _, cached = _resolve(model)
    model_dir = cached / "model" if cached is not None else src
    if not (model_dir / "config.json").is_file():
        return None
    return int(AutoConfig.from_pretrained(str(model_dir)).vocab_size)


def precompile(
    spec: GrammarSpec, *, model: str = "smollm2", grammar_backend: str = "xgrammar"
) -> Any:
    """Compile ``spec`` for ``model`` from its tokenizer alone, before the weights load, so a
    bad grammar fails early; the backend is the cached one :func:`build_worker` then uses, so
    the worker's compile is a cache hit. Returns the
    :class:`~spec_grammar.protocol.CompiledGrammar`; raises
    :class:`~spec_grammar.errors.GrammarCompileError` naming the problem."""
    from ..models import load_tokenizer
    from ..registry import get_backend

    tokenizer = load_tokenizer(model)
    vocab = _config_vocab_size(model)
    if vocab is None:  # width unknown until the model loads: check only (compiled again later)
        return get_backend(grammar_backend, tokenizer).compile(spec)
    return _backend(grammar_backend, model, tokenizer, vocab).compile(spec)


def build_prompt(tokenizer: Any, user: str, *, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat (``system`` optional) ending with the assistant header,
    through the tokenizer's chat template; the plain encoding of ``user`` when the tokenizer
    has no template (base models such as the Gemma-3-270M GGUF)."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return list(tokenizer.encode(user))


def schema_prompt(grammar: GrammarSpec | dict | bool, task: str | None = None) -> str:
    """A user message asking for output in the grammar's format, with the schema / tool list /
    pattern written into it (small models follow a schema they can read far better).

    ``grammar``: a spec or a JSON schema dict. ``task``: what to produce (a generic request
    when None).
    """
    spec = grammar if isinstance(grammar, GrammarSpec) else JsonSchema(grammar)
    task = task or "Produce an example answer."
    if isinstance(spec, JsonSchema):
        return f"{task}\nAnswer with one JSON document valid under this JSON schema:\n{spec.schema_json()}"
    if isinstance(spec, ToolCalls):
        tools = json.dumps(spec.tools, ensure_ascii=False)
        if spec.call_format == "json_array":
            how = 'Answer with a JSON list of calls, each {"name": ..., "arguments": {...}}.'
        else:
            how = (
                f'Call a tool by writing {spec.call_open}{{"name": ..., "arguments": {{...}}}}'
                f"{spec.call_close}"
                + (
                    ", or answer in plain text when no tool fits."
                    if spec.tool_choice == "auto"
                    else "."
                )
            )
        return f"{task}\nYou can call these tools:\n{tools}\n{how}"
    if isinstance(spec, Regex):
        return f"{task}\nAnswer with text matching the regular expression: {spec.pattern}"
    if isinstance(spec, (Ebnf, Lark)):
        return f"{task}\nAnswer in the language of this grammar:\n{spec.text}"
    return task


def build_worker(
    *,
    model: str = "smollm2",
    grammar_backend: str | None = "xgrammar",
    device: str | torch.device | None = "auto",
    dtype: Any = None,
    config: WorkerConfig | None = None,
    **options: Any,
) -> SpecWorker:
    """A :class:`SpecWorker` over a model loaded by :func:`spec_grammar.models.load_model`
    (models and backends are cached per process).

    Args:
        model: ``smollm2``, ``gemma3``, a model directory or a ``.gguf`` file.
        grammar_backend: registered backend name or ``module:Class``; None gives a worker for
            plain requests only.
        device: ``auto`` (CUDA when available) / ``cpu`` / ``cuda``.
        dtype: model dtype (default float32).
        config: the worker's options (:class:`~spec_grammar.worker.config.WorkerConfig`);
            ``**options``, its fields by name (``draft="self:4"``, ``num_draft_tokens=16``,
            ``overlap=False``, ...), override it or WorkerConfig's defaults.

    Raises ``TypeError`` for a keyword that is no option, the option errors of
    :class:`~spec_grammar.worker.config.WorkerConfig` and
    :class:`~spec_grammar.errors.BackendNotFoundError` for an unknown backend (all before
    anything loads), and
    :class:`~spec_grammar.models.ModelNotFoundError` for a missing model."""
    cfg = worker_config(config, options, "build_worker")
    dev = resolve_device(device)
    if grammar_backend is not None:  # an unknown name fails before the weights load ("" too)
        from ..registry import load_backend_class

        load_backend_class(grammar_backend)
    target, tokenizer = _load(model, dtype, dev)
    vocab = int(target.config.vocab_size)
    backend = (
        _backend(grammar_backend, model, tokenizer, vocab) if grammar_backend is not None else None
    )
    return SpecWorker(target, tokenizer, cfg, backend=backend, device=dev)


_BUILD_OPTIONS = tuple(
    name
    for name, param in inspect.signature(build_worker).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY and name != "config"
)
"""What :func:`build_worker` loads: ``model``, ``grammar_backend``, ``device``, ``dtype``."""


def _as_spec(g: Any) -> GrammarSpec | None:
    if g is None or isinstance(g, GrammarSpec):
        return g
    if isinstance(g, (dict, bool)):
        return JsonSchema(g)
    raise TypeError(
        f"a grammar must be a spec (JsonSchema, Regex, Ebnf, Lark, ToolCalls) or a schema dict, got {type(g).__name__}"
    )


def generate(
    prompts_or_requests: str | Request | Sequence[str | Request],
    *,
    grammar: Any = None,
    chat: bool = True,
    config: WorkerConfig | None = None,
    **options: Any,
) -> list[RequestResult]:
    """Generate for a batch of prompts in one worker run.

    Args:
        prompts_or_requests: prompt text(s) (wrapped in the model's chat template when
            ``chat``) or :class:`Request` objects (used as they are: their own grammar and
            sampling params win).
        grammar: one spec (or JSON-schema dict) for every prompt, or a list with one entry
            (or None) per prompt.
        chat: apply the model's chat template to prompt texts.
        config: the worker's options (:class:`~spec_grammar.worker.config.WorkerConfig`).
        **options: by name, each where it is defined:

            - what to load, :func:`build_worker`'s ``model``, ``grammar_backend``, ``device``
              and ``dtype``;
            - the worker's options, :class:`~spec_grammar.worker.config.WorkerConfig`'s fields
              (``draft``, ``num_draft_tokens``, ``no_spec``, ``overlap``, ...), over ``config``;
            - the sampling of every prompt,
              :class:`~spec_grammar.worker.sampling.SamplingParams`' fields (``temperature``,
              ``seed``, ``max_new_tokens``, ``stop`` (a string, a list of strings or None), ...).

    Returns one :class:`RequestResult` per input, in order. A request whose grammar fails to
    compile comes back with ``finish_reason="error"`` and the error; the others complete.
    Raises ``TypeError`` for a keyword that is none of these, ``ValueError`` when a grammar
    list does not match the prompts, pydantic's ``ValidationError`` for bad sampling values,
    and what :func:`build_worker` raises.
    """
    unknown = [
        name
        for name in options
        if name not in _BUILD_OPTIONS
        and name not in SamplingParams.model_fields
        and name not in WorkerConfig.model_fields
    ]
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    items = (
        [prompts_or_requests]
        if isinstance(prompts_or_requests, (str, Request))
        else list(prompts_or_requests)
    )
    grammars = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * len(items)
    if len(grammars) != len(items):
        raise ValueError(f"{len(grammars)} grammars for {len(items)} prompts")
    sampling = {k: options.pop(k) for k in list(options) if k in SamplingParams.model_fields}
    if "stop" in sampling:  # one stop string or several (a str is not a list of 1-char stops)
        stop = sampling["stop"]
        if stop is None or isinstance(stop, str):
            sampling["stop"] = [] if stop is None else [stop]
        elif isinstance(stop, (tuple, set, frozenset)):
            sampling["stop"] = list(stop)
    params = SamplingParams(**sampling)
    specs = [_as_spec(g) for g in grammars]  # a grammar of the wrong type fails before the load
    load = {k: options.pop(k) for k in list(options) if k in _BUILD_OPTIONS}
    worker = build_worker(config=worker_config(config, options, "generate"), **load)
    requests = []
    for item, spec in zip(items, specs):
        if isinstance(item, Request):
            requests.append(item)
            continue
        # only text goes through the chat template; anything else is the request's prompt as
        # given (token ids, or a wrong type that then fails that request alone)
        prompt = build_prompt(worker.tokenizer, item) if chat and isinstance(item, str) else item
        requests.append(Request(prompt=prompt, grammar=spec, sampling=params))
    with worker:
        return worker.run(requests)


class RunSummary(BaseModel):
    """Aggregate numbers of one worker run (what the CLI's ``--json`` and the benchmark print).

    ``tokens_per_s`` = all output tokens over the run's wall time (s); ``accept_length`` =
    output tokens per request-step, over all requests; grammar times are ms per step.
    """

    requests: int
    errors: int
    output_tokens: int
    steps: int
    wall_s: float
    tokens_per_s: float
    accept_length: float
    draft_ms_per_step: float
    verify_forward_ms_per_step: float
    grammar_ms_per_step: float
    grammar_exposed_ms_per_step: float


def summarize(
    results: Sequence[RequestResult], steps: Sequence[StepStats], wall_s: float
) -> RunSummary:
    """Aggregate a run's results and step stats."""
    n_steps = max(len(steps), 1)
    tokens = sum(r.num_tokens for r in results)
    req_steps = sum(r.steps for r in results)
    return RunSummary(
        requests=len(results),
        errors=sum(r.finish_reason == "error" for r in results),
        output_tokens=tokens,
        steps=len(steps),
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        accept_length=tokens / req_steps if req_steps else 0.0,
        draft_ms_per_step=sum(s.draft_ms for s in steps) / n_steps,
        verify_forward_ms_per_step=sum(s.verify_forward_ms for s in steps) / n_steps,
        grammar_ms_per_step=sum(s.grammar_ms for s in steps) / n_steps,
        grammar_exposed_ms_per_step=sum(s.grammar_exposed_ms for s in steps) / n_steps,
    )
