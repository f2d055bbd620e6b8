"""``spec-grammar generate``: constrained generation with tree speculative decoding.

One prompt (``--system`` optional) with a grammar flag, or ``--batch-file`` (JSONL, one request
a line: ``prompt`` or ``messages`` (OpenAI-style system / user / assistant turns) plus its own
grammar field ``json_schema`` (object or file path), ``regex``, ``ebnf``, ``lark`` or ``tools``
(file paths relative to the batch file), and optional sampling fields such as
``max_new_tokens`` / ``temperature`` / ``seed`` / ``stop``: any
:class:`~spec_grammar.worker.sampling_params.SamplingParams` field; ``limits``: an object of output
limits over the flags' ones, or null for none; ``strict``: true / false over ``--strict``).
JSON-schema and tool-call grammars get the output limits of the flags (``--max-digits`` ..., default
:data:`~spec_grammar.json_schema.limits.DEFAULT_OUTPUT_LIMITS`). A line with an unknown key,
one that cannot be turned into a request, or whose grammar fails to compile, is reported as
failed; the other requests complete. One request's text streams to stdout as each draft path
is accepted; ``--json`` prints one final record instead.

Exit code 0 when every request succeeded, 1 when some failed, 2 on bad arguments (missing
files, unknown backend, unreadable schema, bad sampling flags, a CLI grammar that fails to
compile), reported in one line before the model loads, 4 (:data:`INVALID_EXIT_CODE`) when a
completed output breaks its request as written (``valid: false``: a keyword the backend does
not enforce, a stop string cutting a document; one stderr line names each such request and its
first violations), and 3 (:data:`CUT_EXIT_CODE`) when a grammar-constrained output ended at its
token limit (one stderr line names each such request). Where several apply: 1, then 4, then 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import InterruptReported

_GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "lark", "tools")
_REASONING_FIELDS = ("reasoning_end", "max_reasoning_tokens")


CUT_EXIT_CODE = 3
"""Exit code when every request ran but a grammar-constrained output ended at
``--max-new-tokens`` (incomplete: it does not parse); 1 (some request failed) and
:data:`INVALID_EXIT_CODE` win over it."""

INVALID_EXIT_CODE = 4
"""Exit code when a completed output is invalid under its request as written
(``RequestResult.valid`` is False: :mod:`spec_grammar.output_check`); 1 (some request failed)
wins over it."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown (``(default: ...)``), except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, argparse.SUPPRESS) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text under a grammar with tree speculative decoding",
        description="Generate with a real model under a grammar (JSON schema, regex, EBNF, Lark, "
        "tool calls), verifying draft trees against the grammar's tree bitmask. The text streams "
        "to stdout as each draft path is accepted; the stats line goes to stderr. Exit code: 0 "
        f"done, 1 a request failed, 2 bad arguments, {INVALID_EXIT_CODE} an output breaks its "
        f"request as written (valid: false), {CUT_EXIT_CODE} a grammar-constrained "
        "output was cut at --max-new-tokens (incomplete).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("prompt", nargs="?", help="the user prompt (chat template applied)")
    p.add_argument("--system", metavar="TEXT", help="system message before the prompt")
    p.add_argument(
        "--model", default="smollm2", help="smollm2, gemma3, a model directory or a .gguf file"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto = CUDA when available",
    )
    p.add_argument(
        "--batch-file",
        metavar="FILE.jsonl",
        help='one JSON request per line: "prompt" (or "messages", OpenAI-style turns) plus one '
        "grammar field (json_schema, regex, ebnf, lark, tools) and sampling fields, e.g. "
        '{"prompt": "Name a city", "regex": "[A-Z][a-z]+"}; json_schema / tools take an object or '
        "a file path, ebnf / lark grammar text or a file path, paths relative to the batch file",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one final JSON record (per-request results, stats) instead of streaming text",
    )

    g = p.add_argument_group("grammar (one of --json-schema, --regex, --ebnf, --lark, --tools)")
    one = g.add_mutually_exclusive_group()
    one.add_argument(
        "--json-schema", metavar="FILE|JSON", help="JSON schema: a file or inline JSON text"
    )
    one.add_argument("--regex", metavar="RE", help="regular expression the output must match")
    one.add_argument("--ebnf", metavar="FILE", help="GBNF/EBNF grammar file (root rule: root)")
    one.add_argument("--lark", metavar="FILE", help="Lark grammar file (start rule: start)")
    one.add_argument(
        "--tools",
        metavar="FILE|JSON",
        help="OpenAI-style tool list (a file or inline JSON); output = required tool calls",
    )
    g.add_argument(
        "--grammar-backend",
        "--backend",
        dest="grammar_backend",
        default="auto",
        help="auto (per request, the backend that enforces the most of its grammar, then the "
        "fastest: docs/routing.md), xgrammar, outlines, llguidance, an entry point or "
        "module:Class",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="refuse a JSON schema or tool list of which the backend would leave a keyword "
        "unenforced, or an EBNF/Lark grammar it would refuse valid text of (with auto: when no "
        "backend enforces all of it), before the model loads",
    )
    g.add_argument(
        "--no-schema-in-prompt",
        action="store_true",
        help="do not write the schema/tools/pattern into the prompt",
    )

    g.add_argument(
        "--tool-choice",
        default="required",
        metavar="auto|required|NAME",
        help="with --tools: required (a JSON array of calls), auto (free text or tagged "
        "<tool_call>...</tool_call> calls) or a function's name (default: required)",
    )
    g.add_argument(
        "--reasoning-end",
        metavar="TEXT",
        help="reasoning end marker (e.g. '</think>'): free text up to it, the grammar after it "
        "(default: none, the grammar from the first token)",
    )
    g.add_argument(
        "--max-reasoning-tokens",
        type=_positive_int,
        metavar="N",
        help="with --reasoning-end: force the marker after N reasoning tokens (default: no budget)",
    )

    s = p.add_argument_group("speculation (names as in SGLang; the short names still work)")
    s.add_argument(
        "--speculative-algorithm",
        "--draft",
        dest="draft",
        default="ngram",
        metavar="ALGO",
        help="drafter: ngram (prompt lookup), self:L (the target's first L layers), model:PATH "
        "(a smaller model), grammar (forced tokens alone) or none",
    )
    s.add_argument(
        "--speculative-num-steps",
        "--num-steps",
        dest="num_steps",
        type=int,
        default=4,
        metavar="N",
        help="draft depth (model drafters)",
    )
    s.add_argument(
        "--speculative-eagle-topk",
        "--topk",
        dest="topk",
        type=int,
        default=1,
        metavar="K",
        help="draft branches per step (model drafters; not the sampling --top-k)",
    )
    s.add_argument(
        "--speculative-num-draft-tokens",
        "--num-draft-tokens",
        dest="num_draft_tokens",
        type=int,
        default=8,
        metavar="N",
        help="draft tree size, root included",
    )
    s.add_argument("--no-spec", action="store_true", help="plain constrained decoding (no drafts)")
    s.add_argument(
        "--constrain-draft",
        action="store_true",
        help="grammar-constrained drafting (legal tokens only; rows reused for verification)",
    )
    s.add_argument(
        "--forced-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"extend drafts with grammar-forced tokens (default: {_forced_tokens_default()})",
    )

    m = p.add_argument_group("sampling")
    m.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    m.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    m.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)"
    )
    m.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    m.add_argument(
        "--max-new-tokens", type=int, default=256, help="output token budget per request"
    )
    m.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    m.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    m.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    m.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)"
    )

    a = p.add_argument_group("performance (advanced)")
    a.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"CPU threads of the model's forward (default: $OMP_NUM_THREADS if set, else "
        f"{_default_threads_text()})",
    )
    a.add_argument(
        "--no-overlap",
        action="store_true",
        help="grammar work after the verify forward, not under it",
    )
    a.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run the forwards eagerly (CUDA graphs are used on CUDA devices only)",
    )
    a.add_argument(
        "--no-draft-budget",
        action="store_true",
        help="verify every drafted node (default: each step keeps the nodes that pay for their "
        "rows, from measured acceptance and step cost; a request may get none)",
    )
    a.add_argument(
        "--no-fused-forward",
        action="store_true",
        help="run the model's own Hugging Face forward, not our fused decoder (used by default "
        "for Llama-family models)",
    )
    a.add_argument(
        "--grammar-threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="threads sharing a step's grammar work (default: 1; more measured slower with "
        "xgrammar)",
    )
    a.add_argument(
        "--lazy-grammar",
        choices=["auto", "on", "off"],
        default="auto",
        help="verify greedy requests without tree fills, asking the grammar for each greedy token "
        "(auto: on CUDA-graph steps whenever the fills would not hide under the forward)",
    )
    _register_limits(p)
    p.set_defaults(func=run)


def _register_limits(p) -> None:
    """The output-limit flags, in their own help group."""
    from ..json_schema.limit_defaults import DEFAULT_LIMIT_VALUES as D

    g = p.add_argument_group(
        "output limits",
        "bounds the grammar enforces on JSON-schema and tool-call outputs, so that a value "
        "cannot run until --max-new-tokens (docs/output-limits.md)",
    )
    g.add_argument(
        "--max-whitespace",
        type=_positive_int,
        metavar="N",
        help=f"longest whitespace run between JSON tokens (flexible whitespace; default {D['max_whitespace']})",
    )
    g.add_argument(
        "--max-digits",
        type=_positive_int,
        metavar="N",
        help=f"most digits in a number's integer / fraction part (default {D['max_digits']})",
    )
    g.add_argument(
        "--max-string-length",
        type=_nonnegative_int,
        metavar="N",
        help=f"maxLength of strings whose schema sets none (default {D['max_string_length']})",
    )
    g.add_argument(
        "--max-items",
        type=_nonnegative_int,
        metavar="N",
        help=f"maxItems of arrays whose schema sets none (default {D['max_items']})",
    )
    g.add_argument(
        "--closed-objects",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="objects whose schema declares properties and says nothing of others take no others "
        f"(default {'on' if D['closed_objects'] else 'off'})",
    )
    g.add_argument(
        "--no-output-limits",
        action="store_true",
        help="no default limits (the flags above still apply)",
    )


def _output_limits(args):
    """The OutputLimits of the flags: the defaults (none with --no-output-limits), each flag
    given over them."""
    from ..json_schema.limits import DEFAULT_OUTPUT_LIMITS, LIMIT_FIELDS, OutputLimits

    base = {} if args.no_output_limits else DEFAULT_OUTPUT_LIMITS.model_dump()
    given = {k: getattr(args, k) for k in LIMIT_FIELDS if getattr(args, k) is not None}
    return OutputLimits(**(base | given))


def _line_limits(value: Any, base):
    """A batch line's ``limits``: null = none, an object = its fields over ``base``. Raises
    ValueError naming the bad field."""
    from pydantic import ValidationError

    from ..json_schema.limits import OutputLimits
    from ..worker.request import one_line

    if value is None:
        return OutputLimits()
    if not isinstance(value, dict):
        raise ValueError(f"limits must be an object or null, got {_json_type(value)}")
    try:
        return OutputLimits(**(base.model_dump() | value))
    except ValidationError as e:
        raise ValueError(f"bad limits: {one_line(e)}") from None


def _nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def _forced_tokens_default() -> str:
    from ..worker.defaults import DEFAULT_FORCED_TOKENS

    return "on" if DEFAULT_FORCED_TOKENS else "off"


def _default_threads_text() -> str:
    from ..worker.defaults import DEFAULT_CPU_THREADS

    return str(DEFAULT_CPU_THREADS)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {n}")
    return n


def _read_text(path: str, what: str) -> str:
    p = Path(path)
    try:
        if p.is_dir():
            raise ValueError(f"{what} path {path} is a directory, not a file")
        if not p.is_file():
            raise FileNotFoundError(f"{what} file not found: {path}")
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # its message names no file
        raise ValueError(
            f"{what} file {path} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:  # e.g. a name too long for the file system (inline text taken for a path)
        if isinstance(e, FileNotFoundError) and e.filename is None:
            raise
        raise ValueError(
            f"{what} file {path[:80]}{'...' if len(path) > 80 else ''} cannot be read: "
            f"{e.strerror or e}"
        ) from None


def _read_json(path: str, what: str) -> Any:
    text = _read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {path} is not valid JSON: {e}") from None


def _spec_from_fields(
    fields: dict[str, Any], base: Path | None = None, *, files_only: bool = False
):
    """The grammar spec named by one of ``_GRAMMAR_FIELDS``, or None. Values are file paths
    (relative to ``base``) when ``files_only`` (the CLI flags); in a batch line they may also be
    inline (a JSON object/list, grammar text)."""
    from ..specs import Ebnf, JsonSchema, Lark, Regex, ToolCalls

    present = [k for k in _GRAMMAR_FIELDS if fields.get(k) is not None]
    if len(present) > 1:
        raise ValueError(f"give one grammar, got {', '.join(present)}")
    if not present:
        return None
    key = present[0]
    value = fields[key]
    if key in ("regex", "ebnf", "lark") and not isinstance(value, str):
        raise ValueError(
            f"{key} must be a string (the grammar or, for ebnf/lark, a file path), got {_json_type(value)}"
        )
    if key == "regex":
        return Regex(value)

    def path(v: str) -> str:
        return v if base is None or Path(v).is_absolute() else str(base / v)

    if key in ("json_schema", "tools"):
        what = "JSON schema" if key == "json_schema" else "tools"
        if isinstance(value, str):
            if not files_only and value.lstrip()[:1] in ("{", "["):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{what} is not valid JSON: {e}") from None
            else:
                value = _read_json(path(value), what)
        if key == "json_schema" and not isinstance(value, (dict, bool)):
            # parsed already: JsonSchema(str) would re-parse a JSON string as schema text
            raise ValueError(f"a JSON schema must be an object or boolean, got {_json_type(value)}")
        if key == "json_schema":
            return JsonSchema(value)
        return ToolCalls(value, tool_choice=fields.get("tool_choice") or "required")
    what = key.upper() if key == "ebnf" else "Lark"
    one_line = "\n" not in value
    if files_only or (one_line and _is_file(path(value))):
        value = _read_text(path(value), what)
    elif one_line and Path(value).suffix.lower() in (".gbnf", ".ebnf", ".lark"):
        # a grammar-file name that does not exist, not one-line grammar text
        raise ValueError(f"{what} grammar file {path(value)} not found")
    return Ebnf(value) if key == "ebnf" else Lark(value)


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except OSError:  # a name too long for the file system: grammar text, not a path
        return False


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (for error messages)."""
    names = {
        str: "a string",
        list: "an array",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _cli_spec(args):
    """The grammar of the flags: ``--json-schema`` / ``--tools`` take a file or inline JSON
    (text starting with ``{`` or ``[``), ``--ebnf`` / ``--lark`` a file."""
    fields = {
        "json_schema": args.json_schema,
        "regex": args.regex,
        "ebnf": args.ebnf,
        "lark": args.lark,
        "tools": args.tools,
        "tool_choice": args.tool_choice,
    }
    for key in ("json_schema", "tools"):
        value = fields[key]
        if value is not None and value.lstrip()[:1] in ("{", "["):
            try:
                fields[key] = json.loads(value)
            except json.JSONDecodeError as e:
                flag = "--" + key.replace("_", "-")
                raise ValueError(f"{flag}: inline JSON is not valid: {e}") from None
    return _spec_from_fields(fields, files_only=True)


def _sampling(args, overrides: dict[str, Any]):
    """The SamplingParams of one request: the CLI flags, overridden by a batch line's fields.
    Raises ValueError in one line naming the bad flag (``--top-p``) or line field (``'top_p'``)."""
    from pydantic import ValidationError

    from ..worker.sampling_params import SamplingParams

    values = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=list(args.stop),
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
    )
    values.update({k: v for k, v in overrides.items() if k in SamplingParams.model_fields})
    try:
        return SamplingParams(**values)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "sampling"
            where = f"field {name!r}" if name in overrides else f"--{name.replace('_', '-')}"
            parts.append(f"{where}: {err['msg']}")
        raise ValueError("; ".join(parts)) from None


def _worker_config(args):
    """The worker's options from the flags. Raises ValueError in one line naming the bad flag
    (``--num-draft-tokens``), before anything loads."""
    from pydantic import ValidationError

    from ..worker.config import WorkerConfig

    flags = dict(
        draft=None if args.draft == "none" else args.draft,
        topk=args.topk,
        num_steps=args.num_steps,
        num_draft_tokens=args.num_draft_tokens,
        no_spec=args.no_spec,
        overlap=not args.no_overlap,
        constrain_draft=args.constrain_draft,
        cuda_graphs=False if args.no_cuda_graphs else None,
        fused_forward=False if args.no_fused_forward else None,
        draft_budget=not args.no_draft_budget,
        grammar_threads=args.grammar_threads,
        lazy_grammar={"auto": None, "on": True, "off": False}[args.lazy_grammar],
        **({} if args.forced_tokens is None else {"forced_tokens": args.forced_tokens}),
    )
    try:
        return WorkerConfig(**flags)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "options"
            parts.append(f"--{name.replace('_', '-')}: {err['msg']}, got {err['input']!r}")
        raise ValueError("; ".join(parts)) from None


def _jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL file: split at ``\n`` only (``str.splitlines`` also splits at
    U+2028, U+0085 and other characters a JSON string may hold raw, breaking that request and
    shifting every later line number), ``\r\n`` endings and a leading UTF-8 BOM (as Windows
    editors write) dropped."""
    return [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]


def _check_line_keys(rec: dict[str, Any]) -> None:
    """Raise ValueError naming a batch line's unknown keys and listing the accepted ones: a
    misspelt field (``temprature``) would otherwise be ignored without a word."""
    from ..worker.sampling_params import SamplingParams

    accepted = (
        "prompt",
        "messages",
        *_GRAMMAR_FIELDS,
        "tool_choice",
        "limits",
        "strict",
        *_REASONING_FIELDS,
        *SamplingParams.model_fields,
    )
    unknown = [k for k in rec if k not in accepted]
    if unknown:
        raise ValueError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(accepted)}"
        )


def _line_turns(rec: Any, system: str | None) -> list[dict[str, str]]:
    """A batch line's chat turns: its ``messages`` (OpenAI-style) or its ``prompt`` (with
    ``--system`` before it). Raises ValueError naming the problem."""
    from ..worker.api import check_messages

    if not isinstance(rec, dict) or (
        not isinstance(rec.get("prompt"), str) and "messages" not in rec
    ):
        raise ValueError("each line needs a string field 'prompt' or a 'messages' list")
    if "prompt" in rec and "messages" in rec:
        raise ValueError("give 'prompt' or 'messages', not both")
    if "messages" in rec:
        return check_messages(rec["messages"])
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": rec["prompt"]}
    ]


def run(args) -> int:
    if args.prompt is None and not args.batch_file:
        raise ValueError("give a PROMPT or --batch-file")
    # file and grammar-flag errors before torch is imported (a second or more)
    from ..specs import with_limits, with_strict

    if args.max_reasoning_tokens is not None and args.reasoning_end is None:
        raise ValueError("--max-reasoning-tokens needs --reasoning-end")
    from ..registry import check_backend_name

    check_backend_name(args.grammar_backend)  # a misspelt backend is told before any import
    limits = _output_limits(args)
    global_spec = with_strict(with_limits(_cli_spec(args), limits), args.strict)
    from ..precheck import early_refusal

    # a strict refusal, an unclaimed kind or an invalid schema from the declarations alone:
    # told in a second, before torch, the grammar library and the tokenizer load
    refusal = early_refusal(global_spec, args.grammar_backend)
    if refusal is not None:
        raise refusal
    batch_text = _read_text(args.batch_file, "batch") if args.batch_file else None
    base_sampling = _sampling(args, {})

    from ..worker.defaults import apply_cpu_threads

    threads = apply_cpu_threads(args.threads)  # before torch loads: OpenMP reads it once
    # transformers' "Loading weights" bar is noise between the command and its streamed text
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    from ..registry import load_backend_class
    from ..worker.api import _tokenizer as load_tokenizer
    from ..worker.api import (
        build_prompt,
        build_worker,
        model_context_length,
        precompile,
        precompile_all,
        resolve_device,
        summarize,
    )
    from ..worker.api import with_schema as schema_turns
    from ..worker.request import Request, RequestResult

    # bad flags, devices, files and the CLI grammar all fail here, before the model loads;
    # cheapest first (the backend's import brings its library and transformers)
    config = _worker_config(args)
    load_backend_class(args.grammar_backend)
    resolve_device(args.device)

    # (rid, chat turns, spec, sampling) per request, or (rid, error) for a bad line; batch
    # ids are the file's 1-based line numbers, as in the error messages
    items: list[tuple[str, list, Any, Any] | tuple[str, str]] = []
    cli_reasoning = (args.reasoning_end, args.max_reasoning_tokens)
    reasoning: dict[str, tuple[Any, Any]] = {"prompt": cli_reasoning}
    if args.prompt is not None:
        items.append(
            (
                "prompt",
                _line_turns({"prompt": args.prompt}, args.system),
                global_spec,
                base_sampling,
            )
        )
    where: dict[str, str] = {}  # request id -> batch file:line
    if batch_text is not None:
        base = Path(args.batch_file).parent
        for n, line in enumerate(_jsonl_lines(batch_text), 1):
            if not line.strip():
                continue
            where[f"line-{n}"] = f"{args.batch_file}:{n}"
            try:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON: {e}") from None
                turns = _line_turns(rec, args.system)
                _check_line_keys(rec)
                line_limits = _line_limits(rec["limits"], limits) if "limits" in rec else limits
                strict = rec.get("strict", args.strict)
                if not isinstance(strict, bool):
                    raise ValueError(f"strict must be true or false, got {_json_type(strict)}")
                if any(k in rec for k in _GRAMMAR_FIELDS):
                    spec = with_limits(_spec_from_fields(rec, base), line_limits)
                elif "limits" in rec or "strict" in rec:  # the CLI's grammar, this line's options
                    spec = with_limits(_cli_spec(args), line_limits)
                else:
                    spec = global_spec
                if hasattr(spec, "strict"):  # the line's own strict wins over --strict
                    spec = spec.model_copy(update={"strict": strict})
                items.append((f"line-{n}", turns, spec, _sampling(args, rec)))
                reasoning[f"line-{n}"] = tuple(  # type: ignore[assignment]
                    rec.get(k, v) for k, v in zip(_REASONING_FIELDS, cli_reasoning)
                )
            except (ValueError, FileNotFoundError) as e:
                items.append((f"line-{n}", f"{where[f'line-{n}']}: {e}"))
        if not items or (args.prompt is not None and len(items) == 1):
            raise ValueError(f"batch file {args.batch_file} has no requests")
    if global_spec is not None:  # the flags' grammar: a bad one is a bad argument (exit 2)
        precompile(global_spec, model=args.model, grammar_backend=args.grammar_backend)
    # every batch line's grammar too, before the weights: a refused line fails in seconds
    live = [i for i in items if len(i) == 4]
    refused = precompile_all(
        [i[2] for i in live], model=args.model, grammar_backend=args.grammar_backend
    )
    why_refused = {i[0]: why for i, why in zip(live, refused) if why}
    # the prompts from the tokenizer alone too: one past the model's context is told now,
    # not after the load (a 9k-token prompt on an 8k model ran for minutes)
    tokenizer = load_tokenizer(args.model)
    context = model_context_length(args.model)
    prompts: dict[str, list[int]] = {}
    for rid, turns, spec, _ in (i for i in live if i[0] not in why_refused):
        if spec is not None and not args.no_schema_in_prompt:
            turns = schema_turns(turns, spec)
        prompts[rid] = build_prompt(tokenizer, turns)
        if context is not None and len(prompts[rid]) + config.num_draft_tokens >= context:
            why_refused[rid] = (
                f"the prompt is {len(prompts[rid])} tokens; the model's context is {context} "
                f"tokens ({config.num_draft_tokens} kept for a draft tree): shorten the prompt"
            )
    # a refused line is told by its place in the batch file, as a line that does not parse is
    items = [
        (i[0], f"{where.get(i[0], i[0])}: {why_refused[i[0]]}") if i[0] in why_refused else i
        for i in items
    ]
    if all(len(i) == 2 for i in items):  # nothing left to generate: no model load
        for _rid, why in items:
            print(f"error: {why}", file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    {
                        "results": [
                            RequestResult.failed_before_run(rid, why).model_dump()
                            for rid, why in items
                        ]
                    }
                )
            )
        return 1

    worker = build_worker(
        model=args.model,
        grammar_backend=args.grammar_backend,
        device=args.device,
        config=config,
    )
    requests, slots = [], []
    for item in items:
        if len(item) == 2:
            slots.append(item)
            continue
        rid, _turns, spec, sampling = item
        req = Request(
            prompt=prompts[rid],
            grammar=spec,
            sampling=sampling,
            rid=rid,
            reasoning_end=reasoning[rid][0],
            max_reasoning_tokens=reasoning[rid][1],
        )
        slots.append(len(requests))
        requests.append(req)

    streaming = not args.json and len(items) == 1 and len(requests) == 1
    t0 = time.perf_counter()
    with worker, _progress(requests, show=not streaming or not sys.stdout.isatty()) as bar:
        text_stream = _stdout_stream(worker.tokenizer) if streaming else None
        try:
            results = worker.run(requests, on_step=_both(bar, text_stream))
        except KeyboardInterrupt:
            _report_interrupt(worker.step_stats, time.perf_counter() - t0, streaming)
            raise InterruptReported from None
        if text_stream is not None:
            text_stream.close(results)
    wall = time.perf_counter() - t0
    final: list[RequestResult] = []
    for slot in slots:
        if isinstance(slot, tuple):
            final.append(RequestResult.failed_before_run(*slot))
        else:
            final.append(results[slot])
    summary = summarize(final, worker.step_stats, wall)
    for line in _warning_lines(final):
        print(line, file=sys.stderr)
    cut = [
        (r, req)
        for r, req in zip(final, [requests[s] if isinstance(s, int) else None for s in slots])
        if r.finish_reason == "length" and req is not None and req.grammar is not None
    ]
    if args.json:
        runner = {  # what ran: the GPU speed depends on it
            "device": str(worker.runner.device),
            "decoder": "fused" if worker.runner.uses_fused_forward else "hf",
            "cuda_graphs": worker.runner.uses_cuda_graphs,
            "cpu_threads": threads,
            "draft": str(worker.config.draft),
            "forced_tokens": worker.config.forced_tokens,
            "draft_budget": worker.config.draft_budget,
        }
        if str(worker.runner.device) == "cpu":
            from ..worker.decoder import cpu_attention, cpu_gemm

            # "on", or why the small-batch kernels do not run (oneDNN / SDPA do: slower decoding)
            runner["cpu_projections"] = cpu_gemm.status()
            runner["cpu_attention"] = cpu_attention.status()
        # one line: token id lists would take a line per id with an indent (pipe to jq to read)
        print(
            json.dumps(
                {
                    "results": [r.model_dump() for r in final],
                    "summary": summary.model_dump(),
                    "runner": runner,
                    # per step: the draft budget's choice (proposed_nodes -> num_nodes,
                    # forward_rows) and its predicted_ms against step_ms
                    "steps": [s.model_dump() for s in worker.step_stats],
                }
            )
        )
    else:
        for r in final:
            if streaming:
                if r.error:
                    print(f"error: {r.error}", file=sys.stderr)
                break
            if len(final) > 1:
                mark = ", invalid" if r.valid is False else ""
                print(f"--- {r.rid} [{r.finish_reason}{mark}]")
            if r.error:
                print(f"error: {r.error}", file=sys.stderr if len(final) == 1 else sys.stdout)
            else:
                print(r.text)
        print(
            f"{summary.output_tokens} tokens in {summary.wall_s:.2f} s ({summary.tokens_per_s:.1f} tok/s), "
            f"accept length {summary.accept_length:.2f}, grammar {summary.grammar_ms_per_step:.2f} ms/step "
            f"({summary.grammar_exposed_ms_per_step:.2f} exposed), {threads} CPU thread"
            f"{'s' if threads > 1 else ''}, forced tokens {'on' if worker.config.forced_tokens else 'off'}",
            file=sys.stderr,
        )
    from ..output_check import check_output

    for r, req in cut:
        # a cut output can already be a whole document of its grammar (`[a-z ]+`): say which
        # (its result's `valid` stays null: an output cut short is not a finished one)
        whole, _ = check_output(req.grammar, r.text)
        state = {
            True: "it is valid as it stands, but the model had not ended it",
            False: "before its grammar completed: incomplete",
            None: "its grammar has no output check (EBNF, Lark): it may be incomplete",
        }[whole]
        print(
            f"spec-grammar generate: {r.rid}: output cut at --max-new-tokens ({r.num_tokens} "
            f"tokens): {state}; raise --max-new-tokens",
            file=sys.stderr,
        )
    invalid = [r for r in final if r.valid is False]
    for r in invalid:
        shown_v = "; ".join(f"{v.path or '/'}: {v.message}" for v in r.violations[:3])
        more = f" (+{len(r.violations) - 3} more)" if len(r.violations) > 3 else ""
        print(
            f"spec-grammar generate: {r.rid}: output invalid under its request as written "
            f"(backend {r.backend}): {shown_v}{more}",
            file=sys.stderr,
        )
    if summary.errors:
        return 1
    if invalid:
        return INVALID_EXIT_CODE
    return CUT_EXIT_CODE if cut else 0


def _warning_lines(results) -> list[str]:
    """One stderr line per distinct warning (a cause shared by many requests, a grammar
    compiled once, is said once), naming the requests and the backend that served them:
    ``warning: line-1, line-3 (xgrammar): uniqueItems at /: ...``."""
    by_cause: dict[tuple[str, str], list[str]] = {}
    for r in results:
        for w in dict.fromkeys(r.warnings):
            by_cause.setdefault((w, r.backend or ""), []).append(r.rid)
    out = []
    for (w, backend), rids in by_cause.items():
        who = ", ".join(rids[:5]) + (f" (+{len(rids) - 5} more)" if len(rids) > 5 else "")
        out.append(f"warning: {who}{f' ({backend})' if backend else ''}: {w}")
    return out


def _report_interrupt(steps, wall_s: float, streaming: bool) -> None:
    """Say on stderr that Ctrl-C stopped the run, with the stats of the steps done so far
    (``steps``: the worker's :class:`~spec_grammar.worker.request.StepStats` list)."""
    if streaming:  # the streamed text has no newline yet
        sys.stdout.write("\n")
        sys.stdout.flush()
    tokens = sum(s.committed_tokens for s in steps)
    req_steps = sum(s.batch_size for s in steps)
    grammar = sum(s.grammar_ms for s in steps) / max(len(steps), 1)
    print(
        f"spec-grammar generate: interrupted after {len(steps)} steps: {tokens} tokens in "
        f"{wall_s:.2f} s ({tokens / wall_s if wall_s > 0 else 0.0:.1f} tok/s), accept length "
        f"{tokens / req_steps if req_steps else 0.0:.2f}, grammar {grammar:.2f} ms/step",
        file=sys.stderr,
    )


def _stdout_stream(tokenizer):
    """A :class:`~spec_grammar.worker.streaming.TextStream` writing each chunk to stdout as it
    is committed (flushed), a newline after the last."""
    from ..worker.streaming import TextStream

    def write(chunk) -> None:
        sys.stdout.write(chunk.text + ("\n" if chunk.finish_reason is not None else ""))
        sys.stdout.flush()

    return TextStream(tokenizer, write)


def _both(*callbacks):
    """One ``on_step`` callback calling each of ``callbacks`` that is not None."""
    live = [c for c in callbacks if c is not None]
    if not live:
        return None

    def on_step(stats, states):
        for c in live:
            c(stats, states)

    return on_step


class _progress:
    """A rich progress bar on stderr (only on a terminal, for 64+ tokens of budget, and not
    while the text streams to the same terminal) over the requested token budget."""

    def __init__(self, requests, show: bool = True):
        self.total = sum(r.sampling.max_new_tokens for r in requests)
        self.show = show
        self.bar = None

    def __enter__(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        console = Console(stderr=True)
        if not self.show or not console.is_terminal or self.total < 64:
            return None
        self.bar = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.bar.start()
        task = self.bar.add_task("tokens", total=self.total)

        def on_step(_stats, states):
            done = sum(
                s.sampling.max_new_tokens if s.finished else len(s.output_ids) for s in states
            )
            self.bar.update(task, completed=done)

        return on_step

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
