"""Grammars that start mid-output, against the same requests without them.

Two pairs of rows, each on the same prompts, through the speculative worker (SmolLM2, CPU,
greedy, the n-gram drafter), one batch per row, rows alternated over ``--repeats``:

- ``json`` vs ``reasoning+json``: JSONSchemaBench schemas (smallest of each subset) as
  :class:`~spec_grammar.specs.JsonSchema`; the second row adds ``reasoning_end="</think>"``
  with a reasoning budget (``--budget`` tokens, then the marker is forced) and asks the model
  to think first.
- ``tools required`` vs ``tools auto``: BFCL cases as :class:`~spec_grammar.specs.ToolCalls`,
  the JSON array (``tool_choice="required"``) against tagged calls in free text
  (``tool_choice="auto"``).

Per row: output tokens/s (all the batch's output tokens over its wall time, prefill included),
accept length (output tokens per request-step), requests the grammar finished, and how many
of those validate (jsonschema on the document, or on every parsed call's arguments).

    python benchmarks/bench_reasoning_tools.py --schemas 6 --bfcl 6 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
from spec_grammar_bench.inputs import bfcl_tool_cases, jsonschemabench_cases

from spec_grammar import ToolCalls
from spec_grammar.models import load_model, load_tokenizer
from spec_grammar.tool_calls import parse_tool_calls
from spec_grammar.worker import Request, SpecWorker, build_prompt, schema_prompt
from spec_grammar.worker.sampling import SamplingParams

THINK = "First think briefly about the answer, then write </think>, then answer."


def rows(tok, n_schemas: int, n_bfcl: int, budget: int, max_new: int) -> dict[str, list]:
    params = SamplingParams(max_new_tokens=max_new)
    schemas = jsonschemabench_cases(smallest_first=True, max_schema_chars=600)[:n_schemas]
    bfcl = bfcl_tool_cases()[:n_bfcl]
    out: dict[str, list] = {
        "json": [],
        "reasoning+json": [],
        "tools required": [],
        "tools auto": [],
    }
    for c in schemas:
        task = "Produce an example answer."
        out["json"].append(
            (c, Request(build_prompt(tok, schema_prompt(c.spec, task)), c.spec, params))
        )
        out["reasoning+json"].append(
            (
                c,
                Request(
                    build_prompt(tok, schema_prompt(c.spec, f"{task} {THINK}")),
                    c.spec,
                    params,
                    reasoning_end="</think>",
                    max_reasoning_tokens=budget,
                ),
            )
        )
    for c in bfcl:
        for name, spec in (
            ("tools required", c.spec),
            ("tools auto", ToolCalls(c.spec.tools, tool_choice="auto")),
        ):
            out[name].append(
                (c, Request(build_prompt(tok, schema_prompt(spec, c.question)), spec, params))
            )
    return out


def valid(case, spec, text: str) -> bool:
    try:
        if isinstance(spec, ToolCalls):
            _, calls = parse_tool_calls(text, spec)
            fns = {f["name"]: f.get("parameters", {}) for f in spec.functions()}
            for call in calls:
                jsonschema.validate(call["arguments"], fns[call["name"]])
            return True
        jsonschema.validate(json.loads(text), case.schema)
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=6)
    ap.add_argument("--bfcl", type=int, default=6)
    ap.add_argument(
        "--budget", type=int, default=24, help="reasoning tokens before </think> is forced"
    )
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default="xgrammar")
    args = ap.parse_args()

    tok = load_tokenizer("smollm2")
    model = load_model("smollm2")
    table = rows(tok, args.schemas, args.bfcl, args.budget, args.max_new_tokens)
    stats: dict[str, list[tuple[float, float, int, int, int]]] = {k: [] for k in table}
    with SpecWorker(model, tok, backend=args.backend, draft="ngram", num_draft_tokens=6) as worker:
        worker.run([table["json"][0][1]])  # warm-up
        for _ in range(args.repeats):
            for name, reqs in table.items():
                t0 = time.perf_counter()
                results = worker.run([r for _, r in reqs])
                wall = time.perf_counter() - t0
                tokens = sum(r.num_tokens for r in results)
                steps = sum(r.steps for r in results)
                done = [
                    (c, q, r) for (c, q), r in zip(reqs, results) if r.finish_reason == "grammar"
                ]
                ok = sum(valid(c, q.grammar, r.text) for c, q, r in done)
                stats[name].append(
                    (tokens / wall, tokens / max(steps, 1), len(done), ok, len(reqs))
                )
    print(
        "| row | tokens/s | accept length | finished | valid | requests |\n|---|---|---|---|---|---|"
    )
    for name, runs in stats.items():
        tps = statistics.median(r[0] for r in runs)
        acc = statistics.median(r[1] for r in runs)
        _, _, done, ok, n = runs[-1]
        print(f"| {name} | {tps:.1f} | {acc:.2f} | {done} | {ok} | {n} |")


if __name__ == "__main__":
    main()
