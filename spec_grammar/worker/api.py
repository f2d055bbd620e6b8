"""``generate``: the one-call entry point of the speculative worker, and prompt building.

Example::

    from pydantic import BaseModel
    from spec_grammar.worker import generate, schema_prompt

    class User(BaseModel):
        name: str

    [out] = generate(schema_prompt(User, "Invent a user."), grammar=User, on_chunk=print)
    print(out.text, out.finish_reason, out.accept_length, out.message())
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from pydantic import BaseModel

from ..json_schema.limits import DEFAULT_OUTPUT_LIMITS, OutputLimits
from ..specs import (
    Ebnf,
    GrammarSpec,
    JsonSchema,
    Lark,
    Regex,
    ToolCalls,
    as_grammar_spec,
    with_limits,
    with_strict,
)
from .config import WorkerConfig, worker_config
from .engine import SpecWorker
from .request import Request, RequestResult, StepStats
from .sampling import SamplingParams
from .streaming import StreamChunk, TextStream

__all__ = [
    "generate",
    "stream",
    "build_worker",
    "build_prompt",
    "schema_prompt",
    "resolve_device",
    "precompile",
    "precompile_all",
    "model_context_length",
    "summarize",
    "RunSummary",
]

_lock = threading.Lock()
_models: dict[tuple, tuple[Any, Any]] = {}
_backends: dict[tuple, Any] = {}
_tokenizers: dict[str, Any] = {}
_tokenizer_lock = threading.Lock()


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
    from ..models import load_model

    key = (model, str(dtype), str(device))
    with _lock:
        if key not in _models:
            _models[key] = (load_model(model, dtype=dtype, device=device), _tokenizer(model))
        return _models[key]


def _tokenizer(model: str) -> Any:
    """``model``'s tokenizer, cached for the process (:func:`precompile` loads it before the
    weights; the worker then reuses it: a second load cost ~1 s of a CLI start)."""
    from ..models import load_tokenizer

    with _tokenizer_lock:
        if model not in _tokenizers:
            _tokenizers[model] = load_tokenizer(model)
        return _tokenizers[model]


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


def precompile(spec: GrammarSpec, *, model: str = "smollm2", grammar_backend: str = "auto") -> Any:
    """Compile ``spec`` for ``model`` from its tokenizer alone, before the weights load, so a
    bad grammar fails early; the backend is the cached one :func:`build_worker` then uses, so
    the worker's compile is a cache hit. Returns the
    :class:`~spec_grammar.protocol.CompiledGrammar`; raises
    :class:`~spec_grammar.errors.GrammarCompileError` naming the problem, and for an
    :class:`~spec_grammar.errors.UnsupportedGrammarError` (a kind the backend lacks, a strict
    refusal) which registered backends would take the grammar
    (:func:`~spec_grammar.routing.backends_taking`)."""
    from ..errors import UnsupportedGrammarError
    from ..registry import get_backend, load_backend_class
    from ..routing import backends_taking

    cls = load_backend_class(grammar_backend)
    if not getattr(cls.capabilities, spec.kind, False):  # told without building the backend
        raise UnsupportedGrammarError(
            f"[{cls.name}] {spec.kind} grammars are not supported; {backends_taking(spec)}"
        )
    tokenizer = _tokenizer(model)
    vocab = _config_vocab_size(model)
    try:
        if vocab is None:  # width unknown until the model loads: check only (compiled again later)
            return get_backend(grammar_backend, tokenizer).compile(spec)
        return _backend(grammar_backend, model, tokenizer, vocab).compile(spec)
    except UnsupportedGrammarError as e:
        told = type(e)(f"{e}; {backends_taking(spec)}")
        told.backend, told.reason = e.backend, e.reason
        raise told from None


def precompile_all(
    specs: Sequence[GrammarSpec | None], *, model: str = "smollm2", grammar_backend: str = "auto"
) -> list[str | None]:
    """:func:`precompile` of every spec (each distinct one once; None = no grammar): per spec,
    None when it compiles, else the error's message. Every grammar of a command is checked
    this way before the model loads, so a bad one is told in seconds."""
    from ..errors import SpecGrammarError

    seen: dict[str, str | None] = {}
    out: list[str | None] = []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        try:
            key = spec.cache_key()
        except (RecursionError, ValueError):  # nested too deeply to serialize: compile says so
            key = f"unserializable {id(spec)}"
        if key not in seen:
            try:
                precompile(spec, model=model, grammar_backend=grammar_backend)
                seen[key] = None
            except SpecGrammarError as e:
                seen[key] = str(e)
        out.append(seen[key])
    return out


def model_context_length(model: str) -> int | None:
    """``model``'s context length from its saved config (no weights loaded); None when no
    config is on disk yet or it declares none."""
    from transformers import AutoConfig

    from ..models import _resolve
    from .engine import context_length

    src, _, cached = _resolve(model)
    model_dir = cached / "model" if cached is not None else src
    if not (model_dir / "config.json").is_file():
        return None
    return context_length(AutoConfig.from_pretrained(str(model_dir)))


ROLES = ("system", "user", "assistant")
"""The chat roles a ``messages`` list may hold (OpenAI's, without tool turns)."""


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts (OpenAI's chat format: roles
    ``system``, ``user``, ``assistant``, string content). Raises ``ValueError`` naming the first
    bad entry (``messages[2]: role 'tool' ...``) or an empty list."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise ValueError(
                f"messages[{i}] must be an object with 'role' and 'content', got {m!r:.80}"
            )
        if m.get("role") not in ROLES:
            raise ValueError(
                f"messages[{i}]: role {m.get('role')!r} is not one of {', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]: content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def build_prompt(
    tokenizer: Any, user: str | Sequence[dict[str, str]], *, system: str | None = None
) -> list[int]:
    """Token ids of a chat ending with the assistant header, through the tokenizer's chat
    template. ``user``: the user's message, or a whole ``messages`` list (system, user and
    assistant turns, OpenAI's format: :func:`check_messages`); ``system`` (optional) goes first.
    Without a template (base models such as the Gemma-3-270M GGUF): the plain encoding of the
    turns' contents, one per line. Raises ``ValueError`` for a malformed messages list."""
    messages = (
        [{"role": "user", "content": user}] if isinstance(user, str) else check_messages(user)
    )
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


def with_schema(messages: Sequence[dict[str, str]], grammar: Any) -> list[dict[str, str]]:
    """``messages`` with :func:`schema_prompt` applied to the last user turn's content."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = schema_prompt(grammar, m["content"])
            break
    return out


def schema_prompt(grammar: Any, task: str | None = None) -> str:
    """A user message asking for output in the grammar's format, with the schema / tool list /
    pattern written into it (small models follow a schema they can read far better).

    ``grammar``: a spec, a JSON schema dict or a pydantic model class. ``task``: what to
    produce (a generic request when None).
    """
    spec = as_grammar_spec(grammar)
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
    grammar_backend: str | None = "auto",
    device: str | torch.device | None = "auto",
    dtype: Any = None,
    threads: int | None = None,
    config: WorkerConfig | None = None,
    **options: Any,
) -> SpecWorker:
    """A :class:`SpecWorker` over a model loaded by :func:`spec_grammar.models.load_model`
    (models and backends are cached per process).

    Args:
        model: ``smollm2``, ``gemma3``, a model directory or a ``.gguf`` file.
        grammar_backend: ``auto`` (per request, the backend that enforces the most of its
            grammar, then the fastest: :mod:`spec_grammar.routing`), a registered backend
            name or ``module:Class``; None gives a worker for
            plain requests only.
        device: ``auto`` (CUDA when available) / ``cpu`` / ``cuda``.
        dtype: model dtype (default float32).
        threads: on a CPU device, torch's intra-op threads (``torch.set_num_threads``): this
            count, else ``$OMP_NUM_THREADS`` when set, else
            :data:`~spec_grammar.worker.defaults.DEFAULT_CPU_THREADS` (the CLI's policy: one
            thread measured fastest on a busy 2-core host; ``benchmarks/results/startup.md``).
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
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if dev.type == "cpu":
        from .defaults import cpu_threads

        torch.set_num_threads(cpu_threads(threads))
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
"""What :func:`build_worker` takes besides the config: ``model``, ``grammar_backend``,
``device``, ``dtype``, ``threads``."""


Prompt = str | Sequence[dict[str, str]]
"""A prompt text (the user turn) or a ``messages`` list (OpenAI's chat format)."""


def _is_messages(item: Any) -> bool:
    return isinstance(item, (list, tuple)) and bool(item) and all(isinstance(m, dict) for m in item)


def generate(
    prompts_or_requests: Prompt | Request | Sequence[Prompt | Request] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    system: str | None = None,
    grammar: Any = None,
    schema_in_prompt: bool = False,
    chat: bool = True,
    on_chunk: Callable[[StreamChunk], None] | None = None,
    config: WorkerConfig | None = None,
    output_limits: OutputLimits | dict | None = DEFAULT_OUTPUT_LIMITS,
    reasoning_end: str | list[int] | None = None,
    max_reasoning_tokens: int | None = None,
    strict: bool = False,
    **options: Any,
) -> list[RequestResult]:
    """Generate for a batch of prompts in one worker run.

    Args:
        prompts_or_requests: prompt text(s) (the user turn, wrapped in the model's chat
            template when ``chat``), ``messages`` lists (system / user / assistant turns,
            OpenAI's format; a list of such dicts at the top level is one conversation) or
            :class:`Request` objects (used as they are: their own grammar and sampling params
            win).
        messages: one conversation, OpenAI-style (instead of ``prompts_or_requests``).
        system: a system message put before each prompt text or conversation.
        grammar: one grammar for every prompt (a spec, a JSON-schema dict or a pydantic model
            class), or a list with one entry (or None) per prompt.
        schema_in_prompt: write the grammar (schema, tools, pattern) into the last user turn
            (:func:`schema_prompt`), as ``spec-grammar generate`` does by default.
        chat: apply the model's chat template to prompt texts.
        output_limits: the :class:`~spec_grammar.json_schema.limits.OutputLimits` (or a dict
            of its fields) given to every JSON schema / tool-list grammar that sets none of
            its own (``spec.limits is None``; :class:`Request` objects are used as they are);
            default :data:`~spec_grammar.json_schema.limits.DEFAULT_OUTPUT_LIMITS`, None for
            the grammars as written.
        on_chunk: called with a :class:`~spec_grammar.worker.streaming.StreamChunk` each time a
            request commits text (a whole accepted path at a time) and once at its end with
            its ``finish_reason``; :func:`stream` is the iterator form.
        reasoning_end: the reasoning end marker of every prompt (text such as
            ``"</think>"`` or token ids): free text up to it, the grammar after it
            (``docs/reasoning-and-tools.md``); ``max_reasoning_tokens``, its budget.
        config: the worker's options (:class:`~spec_grammar.worker.config.WorkerConfig`).
        strict: refuse a JSON-schema or tool-call grammar of which the backend would leave a
            keyword unenforced (:attr:`~spec_grammar.specs.JsonSchema.strict`; with the
            default ``grammar_backend="auto"``, refused only when no registered backend
            enforces all of it). Every grammar is compiled before the model loads
            (:func:`precompile_all`): a refused one comes back as an error result, and when
            every request is refused the model is not loaded at all.
        **options: by name, each where it is defined:

            - what to load, :func:`build_worker`'s ``model``, ``grammar_backend``, ``device``
              and ``dtype``;
            - the worker's options, :class:`~spec_grammar.worker.config.WorkerConfig`'s fields
              (``draft``, ``num_draft_tokens``, ``no_spec``, ``overlap``, ...), over ``config``;
            - the sampling of every prompt,
              :class:`~spec_grammar.worker.sampling.SamplingParams`' fields (``temperature``,
              ``seed``, ``max_new_tokens``, ``stop`` (a string, a list of strings or None), ...).

    Returns one :class:`RequestResult` per input, in order (:meth:`RequestResult.message`
    reads one as a chat-completion message). A request whose grammar fails to compile comes
    back with ``finish_reason="error"`` and the error; the others complete. Raises
    ``TypeError`` for a keyword that is none of these, ``ValueError`` when a grammar list does
    not match the prompts, for a malformed ``messages`` list or for both ``messages`` and
    prompts, pydantic's ``ValidationError`` for bad sampling values, and what
    :func:`build_worker` raises.
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
    if (messages is None) == (prompts_or_requests is None):
        raise ValueError("give prompts_or_requests or messages=, one of them")
    if messages is not None:
        prompts_or_requests = [check_messages(messages)]
    items = (
        [prompts_or_requests]
        if isinstance(prompts_or_requests, (str, Request)) or _is_messages(prompts_or_requests)
        else list(prompts_or_requests)
    )
    items = [check_messages(i) if _is_messages(i) else i for i in items]
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
    if isinstance(output_limits, dict):
        output_limits = OutputLimits(**output_limits)
    # a grammar of the wrong type fails before the load
    specs = [with_strict(with_limits(as_grammar_spec(g), output_limits), strict) for g in grammars]
    load = {k: options.pop(k) for k in list(options) if k in _BUILD_OPTIONS}
    cfg = worker_config(config, options, "generate")
    backend_name = load.get("grammar_backend", "auto")
    refused: list[str | None] = [None] * len(items)
    if backend_name is not None:  # every grammar before the weights: a refusal in seconds
        from ..registry import load_backend_class

        load_backend_class(backend_name)
        refused = precompile_all(
            [
                _spec_or_none(i.grammar) if isinstance(i, Request) else s
                for i, s in zip(items, specs)
            ],
            model=load.get("model", "smollm2"),
            grammar_backend=backend_name,
        )
        if all(refused):
            failed = [
                RequestResult.failed_before_run(
                    i.rid if isinstance(i, Request) else Request(prompt="").rid, why
                )
                for i, why in zip(items, refused)
            ]
            if on_chunk is not None:  # each still gets its one chunk, as in a mixed batch
                TextStream(None, on_chunk).close(failed)
            return failed
    worker = build_worker(config=cfg, **load)
    requests = []
    for item, spec in zip(items, specs):
        if isinstance(item, Request):
            requests.append(item)
            continue
        # only text and messages go through the chat template; anything else is the
        # request's prompt as given (token ids, or a wrong type that then fails that request)
        if chat and (isinstance(item, str) or _is_messages(item)):
            turns = [{"role": "user", "content": item}] if isinstance(item, str) else item
            if schema_in_prompt and spec is not None:
                turns = with_schema(turns, spec)
            item = build_prompt(worker.tokenizer, turns, system=system)
        requests.append(
            Request(
                prompt=item,
                grammar=spec,
                sampling=params,
                reasoning_end=reasoning_end,
                max_reasoning_tokens=max_reasoning_tokens,
            )
        )
    text_stream = (
        TextStream(worker.tokenizer, on_chunk, worker.result) if on_chunk is not None else None
    )
    with worker:
        results = worker.run(requests, on_step=text_stream)
    if text_stream is not None:
        text_stream.close(results)
    return results


def _spec_or_none(grammar: Any) -> GrammarSpec | None:
    """A :class:`Request`'s grammar as a spec; None when it is none (the worker then ends the
    request with the type error, as for any bad field)."""
    try:
        return as_grammar_spec(grammar)
    except (TypeError, ValueError):
        return None


def stream(
    prompts_or_requests: Prompt | Request | Sequence[Prompt | Request] | None = None,
    **kwargs: Any,
) -> Iterator[StreamChunk]:
    """:func:`generate` as an iterator of :class:`~spec_grammar.worker.streaming.StreamChunk`
    (each request's committed text as it is accepted; its last chunk has ``finish_reason``).
    Takes :func:`generate`'s arguments (not ``on_chunk``); the run happens in a thread while
    the caller reads, and its exceptions are raised by the iterator. Example::

        for chunk in stream("Name a city.", grammar=City):
            print(chunk.text, end="", flush=True)
    """
    import queue

    if "on_chunk" in kwargs:
        raise TypeError("stream() takes no on_chunk (it yields the chunks)")
    chunks: queue.Queue = queue.Queue()
    done = object()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            generate(prompts_or_requests, on_chunk=chunks.put, **kwargs)
        except BaseException as e:  # re-raised in the reader's thread
            failure.append(e)
        finally:
            chunks.put(done)

    thread = threading.Thread(target=run, name="spec-grammar-stream", daemon=True)
    thread.start()
    while (chunk := chunks.get()) is not done:
        yield chunk
    thread.join()
    if failure:
        raise failure[0]


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
