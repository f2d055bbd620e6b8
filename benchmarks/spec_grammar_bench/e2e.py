"""End-to-end benchmark: our speculative worker against what a user would run today,
Hugging Face ``transformers`` ``generate`` with a grammar logits processor (with and without
HF's own speculative decoding), on the real SmolLM2 model and real schemas.

Method:

- **Prompts**: a fixed sample of the bundled real inputs (JSONSchemaBench schemas spread over
  the subsets, BFCL tool-calling cases as :class:`~spec_grammar.specs.ToolCalls`), each asked
  through the chat template with the schema or tool list written into the message
  (:func:`~spec_grammar_bench.inputs.chat_prompt`). Every row gets the same prompt token ids.
- **Rows**: ours constrained speculative (one row per grammar backend, the n-gram drafter),
  ours constrained non-speculative (``no_spec``), ours unconstrained speculative; HF
  ``generate`` + a grammar processor (xgrammar's ``xgrammar.contrib.hf.LogitsProcessor``;
  for llguidance, which ships no HF processor,
  :class:`~spec_grammar_bench.peers.LLGuidanceLogitsProcessor`, the small processor a user
  writes from llguidance's own ``llguidance.hf`` / ``llguidance.torch`` helpers; both rows are
  :class:`~spec_grammar_bench.peers.HFRow`) without speculation, with prompt lookup
  (``prompt_lookup_num_tokens``) and with an assistant model (the target's first layers,
  sharing weights). Greedy decoding everywhere. With ``output_limits`` (``--output-limits``),
  one more row per backend and limit set: ours constrained speculative with the specs carrying
  those :class:`~spec_grammar.json_schema.limits.OutputLimits` (validated against the case's
  own schema like every row).
- **Timing**: one request at a time (HF assisted generation only takes batch 1). For every
  prompt all rows run one after the other, the order rotated from prompt to prompt
  (interleaved: load changes on a shared machine hit all rows alike), after one untimed
  warm-up generation per row. The grammar is compiled
  before generation and timed apart (*compile ms*, a fresh compile without cache); *tokens/s*
  = output tokens (stop token excluded) over generation wall time (prefill included);
  *accept length* = output tokens per target forward (our verify steps; HF: calls of the
  target model's ``forward``, prefill included); *TTFT* = wall time until the first output
  token is known (our ``on_step`` callback, HF's ``streamer``).
- **Checks**: each finished output (stop token reached) is validated with ``jsonschema``
  (Draft 2020-12) against the case's schema (BFCL: the case's ``required_schema``); outputs
  cut by ``max_new_tokens`` are counted apart. A row that raises is recorded with the error
  text, never dropped. Constrained rows are compared token by token with the reference row
  (HF ``generate`` + xgrammar, no speculation); at the first differing token the target
  model's logits and the reference grammar's mask at the common prefix tell why
  (:func:`explain_divergence`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import jsonschema
import torch
from pydantic import (
    BaseModel,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from spec_grammar.json_schema.limits import OutputLimits
from spec_grammar.specs import GrammarSpec, with_limits

from .inputs import TASK_DOCUMENT, chat_prompt, load_cases
from .peers import HFRow, xgrammar_mask_row

__all__ = [
    "E2EBenchConfig",
    "E2EPrompt",
    "load_prompts",
    "row_specs",
    "run_e2e",
    "summarize_rows",
    "explain_divergence",
    "RESULT_KIND",
    "REFERENCE_ROW",
]

RESULT_KIND = "e2e"
REFERENCE_ROW = "hf/xgrammar"
"""The row every constrained row is compared with token by token."""
Progress = Callable[[str, int, int], None]


class E2EBenchConfig(BaseModel):
    """What :func:`run_e2e` measures. Defaults are the full run; :meth:`quick` the smoke one."""

    model: str = "smollm2"
    # counts >= 0 (a negative count sliced the case list from its end), at least one prompt
    jsb_cases: NonNegativeInt = Field(
        12, description="JSONSchemaBench schemas (round-robin over subsets)"
    )
    bfcl_cases: NonNegativeInt = 8
    shortest_prompts: bool = Field(
        False, description="take each source's shortest prompts instead of a spread"
    )
    max_new_tokens: PositiveInt = 128
    backends: list[str] | None = Field(
        None,
        description="our backends (None: every registered one with JSON Schema and tool calls)",
    )
    hf_processors: list[str] = ["xgrammar", "llguidance"]
    hf_speculation: list[str] = ["none", "prompt_lookup", "assistant"]
    draft: str = "ngram"
    num_draft_tokens: PositiveInt = 8
    prompt_lookup_num_tokens: PositiveInt = 10
    assistant_layers: PositiveInt = 8
    nospec_backend: str = "xgrammar"
    time_budget_s: PositiveFloat | None = Field(
        None,
        description="start no new prompt after this many seconds of generation (the rest are listed as skipped)",
    )
    skip_rows: list[str] = Field(
        [], description="row ids to leave out (e.g. hf/llguidance+assist for time)"
    )
    output_limits: list[OutputLimits] = Field(
        [],
        description="for each entry, one more row per backend (ours-spec/<backend>+limits<i>) whose "
        "specs carry these output limits (spec_grammar.json_schema.limits); outputs are still "
        "validated against the case's own schema",
    )
    warmup: bool = True
    torch_threads: PositiveInt | None = Field(
        1,
        description="torch intra-op threads (None: torch's default). 1 by default: on a shared 2-core machine "
        "2 threads made a 62-token forward 17x slower (0.6 s -> 10 s, OpenMP threads waiting on each other)",
    )

    @model_validator(mode="after")
    def _some_prompts(self) -> E2EBenchConfig:
        if self.jsb_cases + self.bfcl_cases == 0:
            raise ValueError("no prompts: jsb_cases and bfcl_cases are both 0")
        return self

    @classmethod
    def quick(cls, **overrides: Any) -> E2EBenchConfig:
        """A smoke run: the shortest schema + BFCL prompt, 8 new tokens, xgrammar only."""
        base = dict(
            jsb_cases=1,
            bfcl_cases=1,
            shortest_prompts=True,
            max_new_tokens=8,
            backends=["xgrammar"],
            warmup=False,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


@dataclass
class E2EPrompt:
    """One benchmark input: ``spec`` constrains the output, ``schema`` validates it,
    ``prompt_ids`` is the chat prompt every row gets."""

    name: str
    source: str
    spec: GrammarSpec
    schema: Any
    prompt_ids: list[int]


@dataclass
class RowSpec:
    """One row of the report. ``family``: ``ours`` or ``hf``; ``lib``: grammar library (None:
    unconstrained); ``speculation``: ``none``, ``ngram``/drafter name, ``prompt_lookup``,
    ``assistant``."""

    id: str
    label: str
    family: str
    lib: str | None
    speculation: str
    limits: OutputLimits | None = None

    @property
    def constrained(self) -> bool:
        return self.lib is not None


def load_prompts(cfg: E2EBenchConfig, tokenizer: Any) -> list[E2EPrompt]:
    """The fixed prompt sample: the first ``jsb_cases`` JSONSchemaBench cases (round-robin
    over subsets) and the first ``bfcl_cases`` BFCL cases with their user question, the two
    sources alternating; with ``shortest_prompts``, each source's shortest prompts instead
    (for smoke runs). Prompts: :func:`~spec_grammar_bench.inputs.chat_prompt` (schemas ask
    :data:`~spec_grammar_bench.inputs.TASK_DOCUMENT`)."""
    cases = load_cases(None if cfg.shortest_prompts else max(cfg.jsb_cases, cfg.bfcl_cases, 1))
    out: list[list[E2EPrompt]] = []
    for source, count in (("jsonschemabench", cfg.jsb_cases), ("bfcl", cfg.bfcl_cases)):
        mine = []
        for c in cases:
            if c.source == source:
                ids = chat_prompt(tokenizer, c, TASK_DOCUMENT)
                mine.append(E2EPrompt(c.name, c.source, c.spec, c.schema, ids))
        if cfg.shortest_prompts:
            mine.sort(key=lambda p: len(p.prompt_ids))
        out.append(mine[:count])
    # alternate the sources, so a run cut short by its time budget still has both
    jsb, bfcl = out
    mixed = [p for pair in zip(jsb, bfcl) for p in pair]
    n = min(len(jsb), len(bfcl))
    return mixed + jsb[n:] + bfcl[n:]


def row_specs(cfg: E2EBenchConfig, backends: list[str]) -> list[RowSpec]:
    """The rows of a run, ours first; ids are stable keys of the JSON result."""
    rows = [
        RowSpec(f"ours-spec/{b}", f"ours, spec ({cfg.draft}), {b}", "ours", b, cfg.draft)
        for b in backends
    ]
    for i, lim in enumerate(cfg.output_limits):
        tag = "+limits" if len(cfg.output_limits) == 1 else f"+limits{i + 1}"
        said = ", ".join(f"{k}={v}" for k, v in lim.model_dump(exclude_none=True).items())
        rows += [
            RowSpec(
                f"ours-spec/{b}{tag}",
                f"ours, spec ({cfg.draft}), {b}, limits ({said or 'none'})",
                "ours",
                b,
                cfg.draft,
                lim,
            )
            for b in backends
        ]
    if cfg.nospec_backend in backends:
        b = cfg.nospec_backend
        rows.append(RowSpec(f"ours-nospec/{b}", f"ours, no spec, {b}", "ours", b, "none"))
    rows.append(
        RowSpec(
            "ours-spec/unconstrained",
            f"ours, spec ({cfg.draft}), no grammar",
            "ours",
            None,
            cfg.draft,
        )
    )
    names = {
        "none": "",
        "prompt_lookup": f" + prompt lookup ({cfg.prompt_lookup_num_tokens})",
        "assistant": f" + assistant (first {cfg.assistant_layers} layers)",
    }
    for lib in cfg.hf_processors:
        for spec in cfg.hf_speculation:
            suffix = {"none": "", "prompt_lookup": "+pld", "assistant": "+assist"}[spec]
            rows.append(
                RowSpec(
                    f"hf/{lib}{suffix}",
                    f"HF generate + {lib} processor{names[spec]}",
                    "hf",
                    lib,
                    spec,
                )
            )
    return [r for r in rows if r.id not in cfg.skip_rows]


# -- our side ------------------------------------------------------------------------------------


class _OursRow:
    """Runs one of our rows through the public worker API (``build_worker`` + ``run``)."""

    def __init__(self, row: RowSpec, cfg: E2EBenchConfig):
        from spec_grammar.worker import build_worker

        self.row, self.cfg = row, cfg
        self.worker = build_worker(
            model=cfg.model,
            grammar_backend=row.lib,
            draft=None if row.speculation == "none" else cfg.draft,
            num_draft_tokens=cfg.num_draft_tokens,
            no_spec=row.speculation == "none",
            device="cpu",
        )
        self._fresh = None
        if row.lib is not None:
            from spec_grammar.registry import get_backend

            # timed compiles go to a backend without compile cache; the worker's own backend
            # then compiles once, untimed, so generation never includes a compile
            self._fresh = get_backend(
                row.lib,
                self.worker.tokenizer,
                vocab_size=self.worker.runner.vocab_size,
                compile_cache_size=0,
            )

    def _spec(self, p: E2EPrompt) -> GrammarSpec:
        return with_limits(p.spec, self.row.limits)

    def compile(self, p: E2EPrompt) -> float:
        if self._fresh is None:
            return 0.0
        t0 = time.perf_counter()
        self._fresh.compile(self._spec(p))
        ms = (time.perf_counter() - t0) * 1e3
        self.worker.backend.compile(self._spec(p))
        return ms

    def generate(self, p: E2EPrompt, max_new_tokens: int) -> dict[str, Any]:
        from spec_grammar.worker import Request
        from spec_grammar.worker.sampling import SamplingParams

        req = Request(
            prompt=list(p.prompt_ids),
            grammar=self._spec(p) if self.row.constrained else None,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
        )
        first: list[float] = []

        def on_step(_stats: Any, states: Any) -> None:
            if not first and (states[0].output_ids or states[0].finished):
                first.append(time.perf_counter())

        t0 = time.perf_counter()
        [res] = self.worker.run([req], on_step=on_step)
        wall = time.perf_counter() - t0
        if res.finish_reason == "error":
            raise RuntimeError(res.error or "the worker reported an error")
        finish = "length" if res.finish_reason == "length" else "complete"  # stop / tool_calls
        return {
            "token_ids": list(res.token_ids),
            "wall_s": wall,
            "forwards": res.steps,
            "ttft_s": (first[0] - t0) if first else None,
            "finish": finish,
        }

    def close(self) -> None:
        self.worker.close()


# -- checks ----------------------------------------------------------------------------------------


def _validate(text: str, schema: Any) -> tuple[bool, str | None]:
    """(valid, reason) of ``text`` as a JSON document under ``schema`` (Draft 2020-12)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return False, f"not JSON: {e.msg} at {e.pos}"
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    return (err is None), (None if err is None else err.message[:200])


def explain_divergence(
    model: Any,
    tokenizer: Any,
    compiled_xgr: Any,
    prompt_ids: list[int],
    ref: list[int],
    other: list[int],
    stop_id: int,
) -> dict[str, Any]:
    """Why two greedy outputs differ: at the first differing position, the target's logits
    (one plain HF forward over prompt + common prefix, float32) and the reference grammar's
    mask (xgrammar, fed the prefix).

    Returns ``{"pos", "ref_token", "token", "ref_allowed", "token_allowed", "logit_gap",
    "cause"}``; ``logit_gap`` = logit(ref_token) - logit(token); ``cause``:

    - ``mask-ref``: the reference mask forbids the other row's token;
    - ``near-tie``: both allowed and ``|gap| < 0.01`` (float noise picks between two almost
      equal logits);
    - ``mask-row``: both allowed by the reference and the reference token scores clearly
      higher, so a greedy row passed it over only because its own mask forbade it;
    - ``other``: anything else (the other token scores clearly higher yet the reference,
      greedy, did not pick it).

    A missing token past the end of an output is the stop token ``stop_id``.
    """
    pos = 0
    while pos < min(len(ref), len(other)) and ref[pos] == other[pos]:
        pos += 1
    a = ref[pos] if pos < len(ref) else stop_id
    b = other[pos] if pos < len(other) else stop_id
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ref[:pos]])).logits[0, -1].float()
    bits = xgrammar_mask_row(compiled_xgr, ref[:pos], logits.shape[0])

    def allowed(t: int) -> bool:
        return bool((int(bits[t // 32]) >> (t % 32)) & 1) if t < logits.shape[0] else False

    gap = float(logits[a] - logits[b]) if max(a, b) < logits.shape[0] else float("nan")
    if not allowed(b):
        cause = "mask-ref"
    elif abs(gap) < 0.01:
        cause = "near-tie"
    else:
        cause = "mask-row" if gap > 0 else "other"
    return {
        "pos": pos,
        "ref_token": tokenizer.decode([a]),
        "token": tokenizer.decode([b]),
        "ref_allowed": allowed(a),
        "token_allowed": allowed(b),
        "logit_gap": gap,
        "cause": cause,
    }


# -- the run ---------------------------------------------------------------------------------------


def _select_backends(cfg: E2EBenchConfig) -> tuple[list[str], list[dict[str, Any]]]:
    from spec_grammar.registry import list_backends

    infos = list_backends()
    available = [i.name for i in infos if i.error is None]
    # by default the backends that can run every prompt (JSON Schema and tool calls); a
    # regex-only adapter (the example one) would only fail them all
    wanted = cfg.backends or [
        i.name
        for i in infos
        if i.error is None and i.capabilities.json_schema and i.capabilities.tool_calls
    ]
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise ValueError(f"unknown or unusable backend(s) {unknown}; available: {available}")
    return wanted, [{"name": i.name, "version": i.version, "error": i.error} for i in infos]


def run_e2e(cfg: E2EBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON-serializable result (``kind: "e2e"``; see
    :mod:`.e2e_report`). Raises ``ValueError`` for an unknown backend or HF processor."""
    import importlib.metadata

    import transformers

    from spec_grammar.models import load_tokenizer

    warnings.simplefilter("ignore")
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    backends, listing = _select_backends(cfg)
    bad = [p for p in cfg.hf_processors if p not in ("xgrammar", "llguidance")]
    if bad:
        raise ValueError(f"unknown HF grammar processor(s) {bad}: use xgrammar, llguidance")
    tok = load_tokenizer(cfg.model)
    prompts = load_prompts(cfg, tok)
    rows = row_specs(cfg, backends)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load0 = list(os.getloadavg())
    runners: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    try:
        ours_stop: list[int] | None = None
        for r in rows:
            if r.family == "ours":
                runners[r.id] = _OursRow(r, cfg)
                model = runners[r.id].worker.runner.model  # the one model every row uses
                if ours_stop is None and runners[r.id].worker.backend is not None:
                    ours_stop = sorted(runners[r.id].worker.stop_token_ids)
        stop_ids = ours_stop or [int(tok.eos_token_id)]
        for r in rows:
            if r.family == "hf":
                runners[r.id] = HFRow(r, cfg, model, tok, stop_ids)
        total = len(prompts) * len(rows)
        if cfg.warmup and prompts:
            for i, r in enumerate(rows):
                try:
                    runners[r.id].compile(prompts[0])
                    runners[r.id].generate(prompts[0], min(4, cfg.max_new_tokens))
                except Exception:  # the timed run records the failure
                    pass
                if progress:
                    progress("warm-up", i + 1, len(rows))
        done, t_start, skipped = 0, time.perf_counter(), []
        for i, p in enumerate(prompts):
            if (
                i
                and cfg.time_budget_s is not None
                and time.perf_counter() - t_start > cfg.time_budget_s
            ):
                skipped = [
                    q.name for q in prompts[i:]
                ]  # whole prompts only: every row sees the same ones
                prompts = prompts[:i]
                break
            # rotate the order: no row always runs right after another's cache-warming run
            for r in rows[i % len(rows) :] + rows[: i % len(rows)]:
                samples.append(_one(runners[r.id], r, p, cfg, tok))
                done += 1
                if progress:
                    progress("generate", done, total)
    finally:
        for run in runners.values():
            if isinstance(run, _OursRow):
                run.close()
    ref = runners.get(REFERENCE_ROW)
    if isinstance(ref, HFRow):
        _compare(samples, prompts, rows, model, tok, ref, stop_ids, progress)
    result = {
        "kind": RESULT_KIND,
        "config": cfg.model_dump(),
        "meta": {
            "started": started,
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "xgrammar": importlib.metadata.version("xgrammar"),
            "llguidance": importlib.metadata.version("llguidance"),
            "loadavg_start": load0,
            "loadavg_end": list(os.getloadavg()),
            "vocab_size": int(model.config.vocab_size),
            "stop_token_ids": stop_ids,
        },
        "backends": listing,
        "prompts": [
            {"name": p.name, "source": p.source, "prompt_tokens": len(p.prompt_ids)}
            for p in prompts
        ],
        "prompts_skipped": skipped,
        "rows": [
            r.__dict__
            | {
                "constrained": r.constrained,
                "limits": None if r.limits is None else r.limits.model_dump(),
            }
            for r in rows
        ],
        "samples": samples,
    }
    result["summary"] = summarize_rows(result)
    return result


def _one(runner: Any, row: RowSpec, p: E2EPrompt, cfg: E2EBenchConfig, tok: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "row": row.id,
        "prompt": p.name,
        "source": p.source,
        "status": "ok",
        "error": None,
    }
    try:
        rec["compile_ms"] = runner.compile(p) if row.constrained else None
    except Exception as e:
        return rec | {"status": "compile_error", "error": _error_text(e)}
    try:
        out = runner.generate(p, cfg.max_new_tokens)
    except Exception as e:
        return rec | {"status": "error", "error": _error_text(e)}
    text = tok.decode(out["token_ids"], skip_special_tokens=True)
    rec |= out | {"tokens": len(out["token_ids"]), "text": text}
    if out["finish"] == "complete":
        rec["valid"], rec["invalid_reason"] = _validate(text, p.schema)
    else:
        rec["valid"], rec["invalid_reason"] = None, None
    return rec


def _error_text(e: BaseException) -> str:
    """``Type: message`` plus where it was raised (a bare ``assert`` has no message)."""
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = ""
    if frame is not None:
        parts = frame.filename.split(os.sep)
        short = (
            os.sep.join(parts[parts.index("site-packages") + 1 :])
            if "site-packages" in parts
            else parts[-1]
        )
        where = f" at {short}:{frame.lineno}" + (f" `{frame.line.strip()}`" if frame.line else "")
    return (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:240] + where


def _compare(
    samples: list[dict[str, Any]],
    prompts: list[E2EPrompt],
    rows: list[RowSpec],
    model: Any,
    tok: Any,
    ref: HFRow,
    stop_ids: list[int],
    progress: Progress | None,
) -> None:
    """Add ``identical`` (token-identical to the reference row) and, where not, ``divergence``."""
    by = {(s["row"], s["prompt"]): s for s in samples}
    todo = [(r, p) for p in prompts for r in rows if r.constrained and r.id != REFERENCE_ROW]
    for i, (r, p) in enumerate(todo):
        s, base = by[(r.id, p.name)], by[(REFERENCE_ROW, p.name)]
        if s["status"] == "ok" and base["status"] == "ok":
            s["identical"] = s["token_ids"] == base["token_ids"]
            if not s["identical"] and p.name in ref.compiled:
                s["divergence"] = explain_divergence(
                    model,
                    tok,
                    ref.compiled[p.name],
                    p.prompt_ids,
                    base["token_ids"],
                    s["token_ids"],
                    stop_ids[0],
                )
        if progress:
            progress("compare", i + 1, len(todo))


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row: prompts, errors (with counts per message), tokens, tokens/s (sum of tokens over
    sum of wall seconds), decode tokens/s (tokens after the first over the seconds after the
    first token, i.e. without prefill), accept length (tokens per target forward), completed / valid / cut,
    median compile ms and TTFT ms, and the identical fraction vs :data:`REFERENCE_ROW`."""
    out = []
    for row in res["rows"]:
        mine = [s for s in res["samples"] if s["row"] == row["id"]]
        ok = [s for s in mine if s["status"] == "ok"]
        errors: dict[str, int] = {}
        for s in mine:
            if s["status"] != "ok":
                errors[s["error"]] = errors.get(s["error"], 0) + 1
        tokens = sum(s["tokens"] for s in ok)
        wall = sum(s["wall_s"] for s in ok)
        timed = [s for s in ok if s.get("ttft_s") is not None and s["tokens"] > 1]
        decode_wall = sum(s["wall_s"] - s["ttft_s"] for s in timed)
        fwd = sum(s["forwards"] for s in ok)
        completed = [s for s in ok if s["finish"] == "complete"]
        compared = [s for s in mine if "identical" in s]
        causes: dict[str, int] = {}
        for s in compared:
            if "divergence" in s:
                c = s["divergence"]["cause"]
                causes[c] = causes.get(c, 0) + 1
        out.append(
            {
                "row": row["id"],
                "label": row["label"],
                "prompts": len(mine),
                "ok": len(ok),
                "errors": sum(errors.values()),
                "error_counts": errors,
                "tokens": tokens,
                "wall_s": wall,
                "tokens_per_s": tokens / wall if wall > 0 else None,
                "decode_tokens_per_s": sum(s["tokens"] - 1 for s in timed) / decode_wall
                if decode_wall > 0
                else None,
                "forwards": fwd,
                "accept_length": tokens / fwd if fwd else None,
                "completed": len(completed),
                "valid": sum(bool(s["valid"]) for s in completed),
                "cut": sum(s["finish"] == "length" for s in ok),
                "compile_ms_median": _median(
                    [s["compile_ms"] for s in mine if s.get("compile_ms") is not None]
                ),
                "ttft_ms_median": _median(
                    [1e3 * s["ttft_s"] for s in ok if s.get("ttft_s") is not None]
                ),
                "compared": len(compared),
                "identical": sum(s["identical"] for s in compared),
                "divergence_causes": causes,
            }
        )
    return out
