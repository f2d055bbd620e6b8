"""Our CPU worker against vLLM's CPU build in the same run (issue #23): tokens/s, tokens per
CPU-second, step time, accept length, token identity.

Requests (greedy, SmolLM2-135M float32, the same token ids in both engines):

- ``json``: 8 JSONSchemaBench schemas + 4 BFCL tool schemas, each written into the chat prompt
  (:func:`spec_grammar.worker.schema_prompt`); the grammar is the EBNF our xgrammar backend
  compiles the schema (with our default output limits) to, given as EBNF to both vLLM's own
  xgrammar backend and ours, so both constrain to the same language.
- ``prose``: 8 free-text prompts, no grammar (n-gram matches are rare).

Configurations: vLLM plain and with its n-gram drafter (``--vllm-python`` names the vLLM venv's
interpreter; each vLLM configuration runs in its own process, engine start excluded from the
times); ours plain (``no_spec``), fixed trees (``draft_budget=False``) and the default
(adaptive draft budget). Batch 1 runs the requests one at a time; batch 8 / 12, one batch (the
first 8 / all of them). CPU-seconds: the process tree's user + system time over the timed
calls (vLLM's engine process busy-polls). One OMP thread per engine by default (``--threads``).
``--repeats R`` runs every configuration R times, round by round; the table gives medians with
their range, and ratios as medians of per-round ratios (``--configs`` picks configurations).

    .venv/bin/python benchmarks/bench_cpu_peer.py --vllm-python /work/venv-vllm/bin/python \\
        --out benchmarks/results/cpu-peer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from result_job import print_result, run_job  # beside this script

HERE = Path(__file__).resolve()
PROSE = [
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the water cycle to a ten-year-old.",
    "What are some good habits for staying focused while studying?",
    "Write a paragraph about the history of the bicycle.",
    "Explain why the sky is blue.",
    "Give me advice for planting a small vegetable garden.",
    "Describe a walk through a busy market in the morning.",
    "What makes a good friend?",
]


def _cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


# -- the requests ------------------------------------------------------------------------------
def build_requests(max_tokens: int) -> dict[str, list[dict]]:
    """``{"json": [...], "prose": [...]}``, each request ``{"id", "prompt_ids", "ebnf" | None,
    "max_tokens"}``."""
    from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
    from spec_grammar.models import load_tokenizer
    from spec_grammar.registry import get_backend
    from spec_grammar.specs import JsonSchema
    from spec_grammar.worker.api import schema_prompt

    tok = load_tokenizer("smollm2")
    backend = get_backend("xgrammar", tok)
    schemas = [(s["id"], s["schema"]) for s in jsonschemabench_sample("Github_easy")[:8]]
    schemas += [(c["id"], c["required_schema"]) for c in bfcl_cases()[:4]]

    def ids(text: str) -> list[int]:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tok.encode(chat, add_special_tokens=False)

    out: dict[str, list[dict]] = {"json": [], "prose": []}
    for rid, schema in schemas:
        spec = JsonSchema(schema=schema)
        compiled = backend.compile(spec)
        out["json"].append(
            {
                "id": rid,
                "prompt_ids": list(ids(schema_prompt(spec))),
                "ebnf": str(compiled.native.grammar),
                "max_tokens": max_tokens,
            }
        )
    for i, text in enumerate(PROSE):
        out["prose"].append(
            {
                "id": f"prose{i}",
                "prompt_ids": list(ids(text)),
                "ebnf": None,
                "max_tokens": max_tokens,
            }
        )
    return out


def batches(requests: list[dict], sizes: list[int]) -> list[tuple[int, list[list[dict]]]]:
    """Per batch size: the calls (batch 1: one per request; b: the first b, one call)."""
    return [(b, [[r] for r in requests] if b == 1 else [requests[:b]]) for b in sizes]


# -- vLLM (runs inside the vLLM venv) ------------------------------------------------------------
def vllm_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    from vllm_offline import _spec_counters  # beside this script (its directory is on sys.path)

    llm = LLM(
        job["model"],
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=max(job["sizes"]),
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        # the configurations re-run the same prompts: vLLM's prefix cache would skip their
        # prefill from the second one on (ours has none), so it is off for a like-for-like run
        enable_prefix_caching=False,
        structured_outputs_config={"backend": "xgrammar"},
        speculative_config=job["speculative"],
    )
    results = []
    for kind, reqs in job["requests"].items():
        for b, calls in batches(reqs, job["sizes"]):
            before = _spec_counters(llm)
            cpu0, t0 = _cpu_seconds(), time.perf_counter()
            outs = []
            for call in calls:
                prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in call]
                params = [
                    SamplingParams(
                        temperature=0,
                        max_tokens=r["max_tokens"],
                        structured_outputs=StructuredOutputsParams(grammar=r["ebnf"])
                        if r["ebnf"]
                        else None,
                    )
                    for r in call
                ]
                outs += llm.generate(prompts, params, use_tqdm=False)
            seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
            after = _spec_counters(llm)
            spec = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            results.append(
                {
                    "kind": kind,
                    "batch": b,
                    "seconds": seconds,
                    "cpu_seconds": cpu,
                    "spec": spec,
                    "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                }
            )
    return {"results": results}


def run_vllm(python: str, model: str, spec: dict | None, requests, sizes, threads: int) -> dict:
    env = dict(os.environ)
    env.pop("SPEC_GRAMMAR_VLLM_BACKEND", None)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # as ours: OMP_NUM_THREADS threads, unpinned
        OMP_NUM_THREADS=str(threads),
    )
    env.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm-bench"))
    job = {"model": model, "speculative": spec, "requests": requests, "sizes": sizes}
    return run_job([python, str(HERE), "--vllm-job", json.dumps(job)], env=env)


# -- ours ----------------------------------------------------------------------------------------
def run_ours(model: str, options: dict, requests, sizes, threads: int) -> dict:
    from spec_grammar.specs import Ebnf
    from spec_grammar.worker.api import build_worker
    from spec_grammar.worker.request import Request
    from spec_grammar.worker.sampling import SamplingParams

    worker = build_worker(model=model, threads=threads, **options)
    results = []
    with worker:
        for kind, reqs in requests.items():
            for b, calls in batches(reqs, sizes):
                cpu0, t0 = _cpu_seconds(), time.perf_counter()
                outs, steps = [], []
                for call in calls:
                    outs += worker.run(
                        [
                            Request(
                                r["prompt_ids"],
                                Ebnf(text=r["ebnf"]) if r["ebnf"] else None,
                                SamplingParams(max_new_tokens=r["max_tokens"]),
                            )
                            for r in call
                        ]
                    )
                    steps += worker.step_stats
                seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
                busy = [s for s in steps if s.batch_size]
                results.append(
                    {
                        "kind": kind,
                        "batch": b,
                        "seconds": seconds,
                        "cpu_seconds": cpu,
                        "steps": len(busy),
                        "step_ms": sum(s.step_ms for s in busy) / max(len(busy), 1),
                        "nodes_per_step": sum(s.num_nodes for s in busy) / max(len(busy), 1),
                        "proposed_per_step": sum(s.proposed_nodes for s in busy)
                        / max(len(busy), 1),
                        "predicted_vs_measured": [
                            (s.predicted_ms, s.step_ms) for s in busy if s.predicted_ms is not None
                        ],
                        "token_ids": [o.token_ids for o in outs],
                        "finish": [o.finish_reason for o in outs],
                    }
                )
    return {"results": results}


# -- the table -----------------------------------------------------------------------------------
def _strip_stop(ids: list[int], stops: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids


def _rate(result: dict, stops: set[int]) -> tuple[int, float]:
    """(tokens, tokens/s) of one configuration's result at one prompt kind and batch."""
    toks = sum(len(_strip_stop(t, stops)) for t in result["token_ids"])
    return toks, toks / result["seconds"]


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else "-"


def table(runs: dict[str, list[dict]], stops: set[int]) -> str:
    """The Markdown table: per configuration, tok/s as the median over the repeats (their
    range beside it); the ratios are medians of per-repeat ratios (each configuration against
    vLLM's rows of the same repeat, or against our plain decoding when vLLM did not run), with
    their range, so drift between repeats cancels. Token identity is against the plain
    reference of the first repeat, counted over every repeat."""
    peer = "vLLM plain" in runs and "vLLM n-gram" in runs
    plain_name, spec_name = ("vLLM plain", "vLLM n-gram") if peer else ("ours plain",) * 2
    ref = runs[plain_name][0]["results"]
    vs_spec, vs_plain = ("x vLLM spec", "x vLLM plain") if peer else ("x ours plain",) * 2
    repeats = min(len(v) for v in runs.values())
    rows = [
        f"| prompts | batch | config | tok/s | tok/s range | {vs_spec} | {vs_plain} | "
        "x ours plain (range) | tok/CPU-s | ms/step | nodes/step | accept length | "
        f"same tokens as {plain_name} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, base in enumerate(ref):
        for name, reps in runs.items():
            rs = [reps[k]["results"][i] for k in range(repeats)]
            tps = [_rate(r, stops)[1] for r in rs]

            def per_repeat(other: str, rs=rs, tps=tps) -> list[float]:
                return [
                    tps[k] / _rate(runs[other][k]["results"][i], stops)[1] for k in range(repeats)
                ]

            x_spec, x_plain = per_repeat(spec_name), per_repeat(plain_name)
            x_ours = per_repeat("ours plain") if "ours plain" in runs else [float("nan")]
            same = sum(
                _strip_stop(a, stops) == _strip_stop(b, stops)
                for r in rs
                for a, b in zip(r["token_ids"], base["token_ids"])
            )
            r, toks = rs[0], _rate(rs[0], stops)[0]
            if "steps" in r:
                ms, nodes = f"{r['step_ms']:.0f}", f"{r['nodes_per_step']:.1f}"
                accept = toks / max(r["steps"], 1) / base["batch"]
                accept_s = (
                    f"{accept * base['batch']:.2f}/step" if base["batch"] > 1 else f"{accept:.2f}"
                )
            else:
                ms = nodes = "-"
                spec = r.get("spec") or {}
                drafts = spec.get("num_drafts", 0)
                accept_s = (
                    f"{1 + spec.get('num_accepted_tokens', 0) / drafts:.2f}" if drafts else "1.00"
                )
            med = statistics.median
            cpu = toks / max(r["cpu_seconds"], 1e-9)
            rows.append(
                f"| {base['kind']} | {base['batch']} | {name} | {med(tps):.1f} | "
                f"{min(tps):.1f}-{max(tps):.1f} | {med(x_spec):.2f} | {med(x_plain):.2f} | "
                f"{med(x_ours):.2f} ({_spread(x_ours)}) | {cpu:.1f} | {ms} | {nodes} | "
                f"{accept_s} | {same}/{len(base['token_ids']) * repeats} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="the vLLM venv's python (vLLM rows left out without)")
    ap.add_argument("--vllm-job", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1,8,12", help="batch sizes")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of each engine")
    ap.add_argument("--kinds", default="json,prose")
    ap.add_argument("--ours-only", action="store_true", help="skip vLLM (a quick look)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every configuration")
    ap.add_argument(
        "--configs",
        default="vllm-plain,vllm-ngram,plain,fixed,default",
        help="which configurations (ours plain always runs: the ratios need it)",
    )
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if args.vllm_job:
        print_result(vllm_job(json.loads(args.vllm_job)))
        return

    from spec_grammar.models import load_model, load_tokenizer

    sizes = [int(x) for x in args.sizes.split(",")]
    requests = {
        k: v for k, v in build_requests(args.max_tokens).items() if k in args.kinds.split(",")
    }
    model = load_model("smollm2").name_or_path  # the directory our loader writes
    configs = set(args.configs.split(",")) | {"plain"}
    vllm = [
        ("vllm-plain", "vLLM plain", None),
        (
            "vllm-ngram",
            "vLLM n-gram",
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
        ),
    ]
    ours = [
        ("plain", "ours plain", {"no_spec": True}),
        ("fixed", "ours fixed trees", {"draft_budget": False}),
        ("default", "ours default (budget)", {}),
    ]
    runs: dict[str, list[dict]] = {}
    # repeats outermost: every configuration once per round, so drift hits all of them alike
    for rep in range(args.repeats):
        if args.vllm_python and not args.ours_only:
            for key, name, spec in vllm:
                if key in configs:
                    print(f"round {rep + 1}: running {name}", file=sys.stderr, flush=True)
                    run = run_vllm(args.vllm_python, model, spec, requests, sizes, args.threads)
                    runs.setdefault(name, []).append(run)
        for key, name, options in ours:
            if key in configs:
                print(f"round {rep + 1}: running {name}", file=sys.stderr, flush=True)
                run = run_ours(model, options, requests, sizes, args.threads)
                runs.setdefault(name, []).append(run)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(runs))
    tok = load_tokenizer("smollm2")
    md = table(runs, {tok.eos_token_id})
    print(md)
    if args.out:
        Path(args.out + ".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
