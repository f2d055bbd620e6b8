"""Our default decoding (draft budget) against our plain decoding, on one or more checkouts of
this library, interleaved with repeats, for a loaded host (issue #38).

Each repeat runs, for each checkout in turn, one process that builds both workers (plain:
``no_spec``; default) and runs every cell (workload x batch size) with both, alternating, so
that each default / plain ratio comes from two runs a few seconds apart. The requests are
:mod:`bench_cpu_peer`'s (JSON schemas + BFCL tools with their grammars; prose without);
batch 1 runs ``--batch1`` requests one at a time, batch 8 / 12 one batch of the first 8 / 12
(prose has 8 prompts: its batch 12 repeats batch 8). The table: per checkout, cell and
configuration the median tokens/s over the repeats with its range, and the median of the
per-run default / plain ratios with their range; "same" counts outputs identical to plain.

    .venv/bin/python benchmarks/bench_budget_ab.py --tree before=/work/main --tree after=. \\
        --threads 2 --repeats 3 --out benchmarks/results/cpu-peer/budget-ab
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


def one_run(job: dict) -> dict:
    """One process's pass over every cell with both configurations (run in the checkout)."""
    sys.path.insert(0, str(HERE.parent))
    from bench_cpu_peer import batches, build_requests

    from spec_grammar.models import load_model
    from spec_grammar.specs import Ebnf
    from spec_grammar.worker.api import build_worker
    from spec_grammar.worker.request import Request
    from spec_grammar.worker.sampling import SamplingParams

    requests = build_requests(job["max_tokens"])
    model = load_model("smollm2").name_or_path
    workers = {
        "plain": build_worker(model=model, threads=job["threads"], no_spec=True),
        "default": build_worker(model=model, threads=job["threads"]),
    }
    warm = requests["prose"][0]["prompt_ids"]
    for w in workers.values():  # first forwards and allocations out of the timed cells
        w.run([Request(warm, None, SamplingParams(max_new_tokens=8))])
    cells = []
    for kind in job["kinds"]:
        for b in job["sizes"]:
            reqs = requests[kind][: job["batch1"]] if b == 1 else requests[kind]
            (_, calls) = batches(reqs, [b])[0]
            order = list(workers) if job["flip"] % 2 == 0 else list(workers)[::-1]
            cell = {"kind": kind, "batch": b}
            for name in order:
                w = workers[name]
                t0, outs, steps = time.perf_counter(), [], []
                for call in calls:
                    outs += w.run(
                        [
                            Request(
                                r["prompt_ids"],
                                Ebnf(text=r["ebnf"]) if r["ebnf"] else None,
                                SamplingParams(max_new_tokens=r["max_tokens"]),
                            )
                            for r in call
                        ]
                    )
                    steps += [s for s in w.step_stats if s.batch_size]
                seconds = time.perf_counter() - t0
                cell[name] = {
                    "tok_s": sum(len(o.token_ids) for o in outs) / seconds,
                    "token_ids": [o.token_ids for o in outs],
                    "nodes_per_step": sum(s.num_nodes for s in steps) / max(len(steps), 1),
                    "proposed_per_step": sum(s.proposed_nodes for s in steps) / max(len(steps), 1),
                }
            cells.append(cell)
    for w in workers.values():
        w.close()
    return {"cells": cells}


def run_tree(path: str, job: dict) -> dict:
    root = Path(path).resolve()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "adapters")])
    return run_job([sys.executable, str(HERE), "--job", json.dumps(job)], env=env, cwd=root)


def _spread(xs: list[float], fmt: str) -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def table(runs: dict[str, list[dict]]) -> str:
    rows = [
        "| checkout | prompts | batch | plain tok/s | default tok/s | default / plain | "
        "nodes/step (proposed) | same as plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tree, reps in runs.items():
        for i, cell in enumerate(reps[0]["cells"]):
            cs = [r["cells"][i] for r in reps]
            plain = [c["plain"]["tok_s"] for c in cs]
            default = [c["default"]["tok_s"] for c in cs]
            ratio = [d / p for d, p in zip(default, plain)]
            nodes = statistics.median(c["default"]["nodes_per_step"] for c in cs)
            prop = statistics.median(c["default"]["proposed_per_step"] for c in cs)
            same = sum(
                a == b
                for c in cs
                for a, b in zip(c["default"]["token_ids"], c["plain"]["token_ids"])
            )
            total = sum(len(c["plain"]["token_ids"]) for c in cs)
            rows.append(
                f"| {tree} | {cell['kind']} | {cell['batch']} | {_spread(plain, '.1f')} | "
                f"{_spread(default, '.1f')} | {_spread(ratio, '.2f')} | {nodes:.1f} ({prop:.1f}) "
                f"| {same}/{total} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--tree", action="append", help="NAME=PATH of a checkout (repeatable)")
    ap.add_argument("--sizes", default="1,8,12")
    ap.add_argument("--kinds", default="prose,json")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1", type=int, default=4, help="requests run one at a time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if args.job:
        print_result(one_run(json.loads(args.job)))
        return
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={HERE.parent.parent}"]))
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for rep in range(args.repeats):
        for name, path in trees.items():
            job = {
                "max_tokens": args.max_tokens,
                "threads": args.threads,
                "sizes": [int(x) for x in args.sizes.split(",")],
                "kinds": args.kinds.split(","),
                "batch1": args.batch1,
                "flip": rep,
            }
            print(f"repeat {rep + 1}: {name}", file=sys.stderr, flush=True)
            runs[name].append(run_tree(path, job))
            if args.out:
                Path(args.out + ".json").write_text(json.dumps(runs))
            print(table({n: r for n, r in runs.items() if r}), file=sys.stderr, flush=True)
    md = table(runs)
    print(md)
    if args.out:
        Path(args.out + ".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
