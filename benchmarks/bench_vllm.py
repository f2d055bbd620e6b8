"""vLLM with its own xgrammar backend vs vLLM with our backends, both with vLLM's n-gram
drafter, vs our own ``spec-grammar generate``, on the same JSONSchemaBench requests.

Requests: the first ``--n`` schemas of a JSONSchemaBench subset, the schema written into the
chat prompt (:func:`spec_grammar.worker.schema_prompt`), greedy, ``--max-tokens`` each, one
batch. Each vLLM configuration runs in its own process (``benchmarks/vllm_offline.py``; vLLM
0.32 CPU build, SmolLM2 float32 from the directory our loader writes). Per row: the batch's
wall time (generate call only, engine start excluded), output tokens, tokens/s, mean accept
length (1 + accepted drafts per drafting step, vLLM's counters), outputs that are complete and
valid under the schema (jsonschema). Schemas vLLM's own xgrammar front-end check refuses are
skipped (one refused schema aborts vLLM's whole generate call) and listed.
``spec-grammar generate`` runs the same prompts
(``--no-schema-in-prompt``, the prompt already holding the schema) with its default n-gram
tree drafter and ``--json`` stats, when ``--spec-grammar CMD`` names its executable.

``--whitespace`` compares JSON rules instead, without speculation: vLLM's own xgrammar backend,
ours under vLLM's rule (the default: any JSON whitespace and objects closed, as vLLM's xgrammar
writes JSON), ours with objects open (``SPEC_GRAMMAR_VLLM_OBJECTS=open``) and with our
``spaced`` whitespace too; the ``valid`` column is the share of complete (finish reason
``stop``) and valid outputs.

``--drafter`` compares drafters instead, all on our backend (``--backend``, default xgrammar):
no speculation, vLLM's n-gram drafter, and our grammar-aware drafter
(:class:`spec_grammar.integrations.vllm.drafter.GrammarNgramProposer`: the n-gram draft cut to
its grammar-legal prefix and extended with grammar-forced tokens), 4 draft tokens each; per row
also vLLM's drafting steps, drafted and accepted tokens, and outputs token-identical to the
run without speculation. ``--workload bfcl`` runs BFCL tool-calling cases instead of
JSONSchemaBench schemas (the tool list in the prompt, the case's ``required_schema`` as the
JSON-schema constraint).

Run from the vLLM venv (scripts/test_vllm.sh builds one), e.g.::

    .venv-vllm/bin/python benchmarks/bench_vllm.py --n 8 --spec-grammar .venv/bin/spec-grammar
    .venv-vllm/bin/python benchmarks/bench_vllm.py --n 8 --max-tokens 128 --drafter \
        --out benchmarks/results/vllm-cpu-drafter.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
from result_job import run_job  # beside this script

from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.specs import ToolCalls
from spec_grammar.worker.api import schema_prompt

HERE = Path(__file__).resolve().parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
OURS = {
    "method": "custom_class",
    "model": "spec_grammar.integrations.vllm.drafter.GrammarNgramProposer",
    "num_speculative_tokens": 4,
}
# (row label, vLLM backend name, our backend or None for vLLM's own, speculative_config,
# environment of our JSON rule: None = vLLM's rule)
CONFIGS = [
    ("vLLM xgrammar + n-gram", "xgrammar", None, NGRAM, None),
    ("vLLM + ours (xgrammar) + n-gram", "guidance", "xgrammar", NGRAM, None),
    ("vLLM + ours (llguidance) + n-gram", "guidance", "llguidance", NGRAM, None),
]
WHITESPACE_CONFIGS = [
    ("vLLM xgrammar", "xgrammar", None, None, None),
    ("vLLM + ours (xgrammar), vLLM's rule", "guidance", "xgrammar", None, None),
    ("vLLM + ours (llguidance), vLLM's rule", "guidance", "llguidance", None, None),
    (
        "vLLM + ours (xgrammar), vLLM's whitespace, objects open",
        "guidance",
        "xgrammar",
        None,
        {"SPEC_GRAMMAR_VLLM_OBJECTS": "open"},
    ),
    (
        "vLLM + ours (xgrammar), spaced, objects open",
        "guidance",
        "xgrammar",
        None,
        {"SPEC_GRAMMAR_VLLM_WHITESPACE": "spaced", "SPEC_GRAMMAR_VLLM_OBJECTS": "open"},
    ),
]


def drafter_configs(backend: str) -> list[tuple[str, str, str, dict | None, None]]:
    """``--drafter``: no speculation (the token-identity oracle), vLLM's n-gram, ours."""
    return [
        (f"vLLM + ours ({backend}), no speculation", "guidance", backend, None, None),
        (f"vLLM + ours ({backend}) + vLLM n-gram", "guidance", backend, NGRAM, None),
        (f"vLLM + ours ({backend}) + our grammar drafter", "guidance", backend, OURS, None),
    ]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def run_vllm(
    model: str,
    backend: str,
    ours: str | None,
    speculative: dict | None,
    requests: list[dict],
    rule: dict[str, str] | None = None,
) -> dict:
    env = dict(os.environ)
    for var in (
        "SPEC_GRAMMAR_VLLM_BACKEND",
        "SPEC_GRAMMAR_VLLM_WHITESPACE",
        "SPEC_GRAMMAR_VLLM_OBJECTS",
    ):
        env.pop(var, None)
    if ours:
        env["SPEC_GRAMMAR_VLLM_BACKEND"] = ours
    env.update(rule or {})
    job = {"model": model, "structured_backend": backend, "speculative": speculative}
    job["requests"] = requests
    return run_job([sys.executable, str(HERE / "vllm_offline.py"), json.dumps(job)], env=env)


def run_ours(cmd: str, prompts: list[str], schemas: list[dict], max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        batch = Path(d) / "batch.jsonl"
        batch.write_text(
            "".join(
                json.dumps({"prompt": p, "json_schema": s, "max_new_tokens": max_tokens}) + "\n"
                for p, s in zip(prompts, schemas)
            )
        )
        start = time.perf_counter()
        proc = subprocess.run(
            [cmd, "generate", "--batch-file", str(batch), "--no-schema-in-prompt", "--json"],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return {"wall": wall, "out": json.loads(proc.stdout)}


def workload(args: argparse.Namespace) -> tuple[list[str], list[dict], list[str]]:
    """(prompts, JSON schemas, ids skipped) of the first ``args.n`` cases."""
    if args.workload == "bfcl":
        cases = bfcl_cases()[: args.n]
        prompts = [
            schema_prompt(ToolCalls(c["tools"]), task=c["messages"][0][-1]["content"])
            for c in cases
        ]
        return prompts, [c["required_schema"] for c in cases], []
    # vLLM's front end refuses a schema its xgrammar backend cannot serve, and that aborts the
    # whole generate call: keep the first n it accepts (the rest are counted as skipped)
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    cases, skipped = [], []
    for c in jsonschemabench_sample(args.subset):
        if len(cases) == args.n:
            break
        try:
            validate_xgrammar_grammar(
                SamplingParams(structured_outputs=StructuredOutputsParams(json=c["schema"]))
            )
            cases.append(c)
        except (VLLMValidationError, ValueError, TypeError):
            skipped.append(c["id"])
    schemas = [c["schema"] for c in cases]
    return [schema_prompt(s) for s in schemas], schemas, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["jsonschemabench", "bfcl"], default="jsonschemabench")
    ap.add_argument("--subset", default="Github_easy", help="JSONSchemaBench subset")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--spec-grammar", help="the spec-grammar executable (its own venv)")
    ap.add_argument("--drafter", action="store_true", help="compare drafters (see above)")
    ap.add_argument("--whitespace", action="store_true", help="compare JSON whitespace rules")
    ap.add_argument("--backend", default="xgrammar", help="our backend, with --drafter")
    ap.add_argument("--repeats", type=int, default=1, help="runs per config (median time)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "vllm-cpu.json")
    args = ap.parse_args()

    from spec_grammar.models import load_model

    model = load_model("smollm2").name_or_path
    prompts, schemas, skipped = workload(args)
    if skipped:
        print(f"schemas vLLM's xgrammar refuses (skipped): {skipped}")
    requests = [
        {"prompt": p, "max_tokens": args.max_tokens, "structured": {"json": s}}
        for p, s in zip(prompts, schemas)
    ]
    configs = (
        drafter_configs(args.backend)
        if args.drafter
        else WHITESPACE_CONFIGS
        if args.whitespace
        else CONFIGS
    )
    rows = []
    for rep in range(args.repeats):  # configurations interleaved: load drifts hit all alike
        for i, (label, backend, ours, speculative, rule) in enumerate(configs):
            r = run_vllm(model, backend, ours, speculative, requests, rule)
            outs = r["outputs"]
            if rep:  # a repeat only adds a time; greedy outputs and counters do not change
                rows[i]["seconds_all"].append(r["seconds"])
                rows[i]["same_as_first_repeat"] &= rows[i]["token_ids"] == [
                    o["token_ids"] for o in outs
                ]
                continue
            tokens = sum(len(o["token_ids"]) for o in outs)
            spec = r["spec"] or {}
            drafts = spec.get("num_drafts", 0)
            accepted = spec.get("num_accepted_tokens", 0)
            rows.append(
                {
                    "config": label,
                    "seconds_all": [r["seconds"]],
                    "same_as_first_repeat": True,
                    "tokens": tokens,
                    "drafting_steps": drafts,
                    "drafted": spec.get("num_draft_tokens", 0),
                    "accepted": accepted,
                    "accept_length": 1 + accepted / drafts if drafts else None,
                    # target steps summed over requests: each gives one token + accepted drafts
                    "tokens_per_step": tokens / (tokens - accepted),
                    "complete": sum(o["finish_reason"] == "stop" for o in outs),
                    "valid": sum(
                        o["finish_reason"] == "stop" and valid(o["text"], s)
                        for o, s in zip(outs, schemas)
                    ),
                    "token_ids": [o["token_ids"] for o in outs],
                }
            )
            print(label, {k: v for k, v in rows[-1].items() if k != "token_ids"})
    for row in rows:
        row["seconds"] = statistics.median(row["seconds_all"])
        row["tok_s"] = row["tokens"] / row["seconds"]
    if args.spec_grammar and not (args.drafter or args.whitespace):
        r = run_ours(args.spec_grammar, prompts, schemas, args.max_tokens)["out"]
        summary = r["summary"]
        rows.append(
            {
                "config": "spec-grammar generate (xgrammar)",
                "seconds": summary["wall_s"],
                "tokens": summary["output_tokens"],
                "tok_s": summary["tokens_per_s"],
                "accept_length": summary["accept_length"],
                "valid": sum(
                    o["error"] is None and valid(o["text"], s)
                    for o, s in zip(r["results"], schemas)
                ),
                "token_ids": [o["token_ids"] for o in r["results"]],
            }
        )
        print(rows[-1]["config"], {k: v for k, v in rows[-1].items() if k != "token_ids"})
    # same grammar (our xgrammar, spaced JSON) as generate; vLLM's ids end with the stop token,
    # generate's do not
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).eos_token_id

    def strip_eos(ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == eos else ids

    base_row = 0 if args.drafter else 1  # no speculation / vLLM + ours (xgrammar) + n-gram
    base = [strip_eos(t) for t in rows[base_row]["token_ids"]]
    n = len(requests)
    what = "BFCL cases" if args.workload == "bfcl" else f"{args.subset} schemas"
    print(f"\n{n} {what}, greedy, max {args.max_tokens} tokens, one batch")
    if args.repeats > 1:
        print(f"s: median of {args.repeats} runs per config, interleaved")
    spec_cols = (
        " drafting steps | drafted | accepted | tokens per target step |" if args.drafter else ""
    )
    print(
        f"| config | s | tokens | tok/s |{spec_cols} accept length | valid | same tokens as row {base_row + 1} |"
    )
    print("|---" * (7 + 4 * args.drafter) + "|")
    for row in rows:
        same = sum(strip_eos(a) == b for a, b in zip(row["token_ids"], base))
        al = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
        counts = (
            f" {row['drafting_steps']} | {row['drafted']} | {row['accepted']} "
            f"| {row['tokens_per_step']:.2f} |"
            if args.drafter
            else ""
        )
        print(
            f"| {row['config']} | {row['seconds']:.1f} | {row['tokens']} | {row['tok_s']:.1f} "
            f"|{counts} {al} | {row['valid']}/{n} | {same}/{n} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"workload": args.workload, "subset": args.subset, "skipped": skipped, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
