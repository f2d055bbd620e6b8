"""What compile isolation costs: ``backend.compile`` with ``isolation="thread"`` vs
``isolation="process"`` (:mod:`spec_grammar.compile_worker`) on ordinary real schemas, per
backend, side by side in one run.

Inputs: ``--schemas`` JSONSchemaBench sample schemas (taken round-robin over its subsets) and
``--tools`` BFCL tool lists (``ToolCalls``), SmolLM2 tokenizer. Per backend: one backend per
isolation, no compile cache; the process one's pool warmed first (its child start is reported
apart: a server pays it once, at start). Each spec is compiled ``--reps`` times on both,
alternating which goes first, and the fastest of each kept (the host is shared: the minimum
is the least disturbed); then a cache hit on a cache of one entry. Specs that fail on either
are left out of the ratio (counted).

Reported per backend and isolation: ms per compile (mean and median over the specs both
compiled), the process/thread ratio of the total time (target < 1.10), and the cache hit in
µs (no process involved).

    python benchmarks/bench_compile_isolation.py [--backends outlines,xgrammar,llguidance]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from spec_grammar import get_backend
from spec_grammar.compile import CompileCache
from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.errors import SpecGrammarError
from spec_grammar.models import load_tokenizer
from spec_grammar.specs import JsonSchema, ToolCalls


def ordinary_specs(n_schemas: int, n_tools: int) -> list:
    """Round-robin over the JSONSchemaBench subsets, then BFCL tool lists."""
    by_subset: dict[str, list] = {}
    for row in jsonschemabench_sample():
        by_subset.setdefault(row["subset"], []).append(row["schema"])
    mixed = [s for group in itertools.zip_longest(*by_subset.values()) for s in group if s]
    specs = [JsonSchema(s) for s in mixed[:n_schemas]]
    specs += [ToolCalls(c["tools"]) for c in bfcl_cases()[:n_tools]]
    return specs


def _timed(backend, spec) -> float | None:
    t0 = time.perf_counter()
    try:
        backend.compile(spec)
    except SpecGrammarError:
        return None
    return time.perf_counter() - t0


def measure(name: str, tok, specs: list, reps: int) -> dict:
    """Thread vs process compile times of ``specs`` on backend ``name``."""
    t0 = time.perf_counter()
    process = get_backend(name, tok, isolation="process", compile_cache_size=0)
    process.compile_pool.warm(120)
    start_s = time.perf_counter() - t0
    thread = get_backend(name, tok, isolation="thread", compile_cache_size=0)
    times: dict[str, list[float]] = {"thread": [], "process": []}
    hits: dict[str, list[float]] = {"thread": [], "process": []}
    failed = 0
    for i, spec in enumerate(specs):
        got: dict[str, list] = {"thread": [], "process": []}
        for r in range(reps):
            order = [("thread", thread), ("process", process)]
            if (i + r) % 2:
                order.reverse()
            for mode, b in order:
                got[mode].append(_timed(b, spec))
        if any(None in v for v in got.values()):
            failed += 1
            continue
        for mode, b in (("thread", thread), ("process", process)):
            times[mode].append(min(got[mode]))
            b._cache = CompileCache(1)  # a cache hit: the lookup every later request makes
            b.compile(spec)
            hits[mode].append(_timed(b, spec))
            b._cache = CompileCache(0)
    process.compile_pool.close()
    return {"backend": name, "start_s": start_s, "times": times, "hits": hits, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="outlines,xgrammar,llguidance")
    ap.add_argument("--schemas", type=int, default=21)
    ap.add_argument("--tools", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    tok = load_tokenizer("smollm2")
    specs = ordinary_specs(args.schemas, args.tools)
    print(f"{len(specs)} specs ({args.schemas} JSONSchemaBench, {args.tools} BFCL tool lists)\n")
    print(
        "| backend | isolation | specs | ms/compile (mean) | median | ratio (total) | "
        "cache hit µs | child start s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.backends.split(","):
        r = measure(name, tok, specs, args.reps)
        base = sum(r["times"]["thread"])
        for mode in ("thread", "process"):
            ts = r["times"][mode]
            if not ts:
                print(f"| {name} | {mode} | 0 (failed {r['failed']}) | | | | | |")
                continue
            ratio = sum(ts) / base if base else float("nan")
            start = f"{r['start_s']:.1f}" if mode == "process" else ""
            print(
                f"| {name} | {mode} | {len(ts)} (failed {r['failed']}) | "
                f"{1e3 * statistics.mean(ts):.1f} | {1e3 * statistics.median(ts):.1f} | "
                f"{ratio:.2f} | {1e6 * statistics.median(r['hits'][mode]):.0f} | {start} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
