"""Tree-fill time of one step at serving batch sizes vs fill threads, side by side (issue 35).

For each backend, tokenizer, batch size and tree size: ``batch`` requests over real
JSONSchemaBench schemas (request ``i`` takes schema ``i mod 84``, walked a seeded
``8 + i mod 16`` legal tokens into its grammar, so no two requests share a state), each with a
draft tree of legal tokens (a chain plus one legal sibling per chain node, as
``bench_grammar_threads.py`` builds them: every node costs a full row). Timed:

* ``one-by-one``: each request's own ``fill_tree_bitmask`` in turn (what a walk per request
  costs, SGLang's pattern with a native walk);
* ``batch xT``: one ``backend.fill_tree_bitmasks`` call over the whole batch with the backend's
  ``num_threads = T``.

Every variant's rows and validity must equal the one-by-one fill's (a mismatch is printed and
recorded). Times: best and median of ``--reps`` interleaved repetitions, milliseconds per step;
``x1`` = the batch fill at 1 thread over this variant (median).

    python benchmarks/bench_tree_fill.py --batches 128 --nodes 16,64 --threads 1,2,4,8,16 \\
        --backends xgrammar,llguidance --out benchmarks/results/tree-fill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from bench_grammar_threads import legal_tree, legal_walk

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.errors import SpecGrammarError
from spec_grammar.specs import JsonSchema


def _set_threads(backend, threads: int) -> None:
    backend.num_threads = threads


def _requests(backend, batch: int, nodes: int, seed: int):
    """``batch`` (matcher, tree) pairs, see the module docstring."""
    stops = set(backend.tokenizer_info.stop_token_ids)
    row = allocate_token_bitmask(1, backend.vocab_size)
    compiled = []
    for r in jsonschemabench_sample():
        try:
            compiled.append(backend.compile(JsonSchema(r["schema"])))
        except SpecGrammarError:  # a schema the backend refuses is left out
            continue
    out = []
    rng = random.Random(seed)
    for i in range(batch):
        m = backend.matcher(compiled[i % len(compiled)])
        walked = legal_walk(m, 8 + i % 16, rng, row, stops)
        out.append((m, legal_tree(m, walked[-1] if walked else 0, nodes, rng, row, stops)))
    return out


def bench(backend, batch: int, nodes: int, threads: list[int], reps: int, seed: int) -> dict:
    pairs = _requests(backend, batch, nodes, seed)
    jobs, rows = [], 0
    for m, t in pairs:
        jobs.append((m, t, rows))
        rows += t.num_nodes
    variants = ["one-by-one"] + [f"batch x{t}" for t in threads]
    times = {v: [] for v in variants}
    masks = {v: allocate_token_bitmask(rows, backend.vocab_size) for v in variants}
    valids = {}
    for _ in range(reps):
        for v in variants:
            mask = masks[v]
            if v == "one-by-one":
                t0 = time.perf_counter()
                got = [m.fill_tree_bitmask(t, mask, off) for m, t, off in jobs]
            else:
                _set_threads(backend, int(v.split("x")[1]))
                t0 = time.perf_counter()
                got = backend.fill_tree_bitmasks(jobs, mask)
            times[v].append((time.perf_counter() - t0) * 1e3)
            valids[v] = [g.tolist() for g in got]
    ref = variants[0]
    base = statistics.median(times[f"batch x{threads[0]}"])
    out = dict(batch=batch, nodes=nodes, rows=rows, variants=[])
    for v in variants:
        same = torch.equal(masks[v], masks[ref]) and valids[v] == valids[ref]
        med = statistics.median(times[v])
        out["variants"].append(
            dict(
                variant=v,
                best_ms=min(times[v]),
                median_ms=med,
                speedup=base / med,
                us_per_row=med * 1e3 / rows,
                rows_equal=same,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizers", default="smollm2", help="smollm2, gemma3, NAME=DIR (comma)")
    ap.add_argument("--backends", default="xgrammar")
    ap.add_argument("--batches", default="128")
    ap.add_argument("--nodes", default="16,64")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="model head width (default: 8B shape's)"
    )
    ap.add_argument("--out", default=None, help="folder for tree-fill.json / tree-fill.md")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from spec_grammar_bench.gpu import _load_tokenizer

    from spec_grammar.registry import get_backend
    from spec_grammar.testing.model_shapes import MODEL_SHAPES

    threads = [int(x) for x in args.threads.split(",")]
    res = dict(cpus=os.cpu_count(), load=os.getloadavg(), reps=args.reps, rows=[])
    lines = [
        f"tree fill of one step, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
        f"{args.reps} reps, ms per step",
        f"{'backend':>10} {'tokenizer':>9} {'batch':>5} {'nodes':>5} {'variant':>11} "
        f"{'best ms':>8} {'median ms':>9} {'x1':>6} {'us/row':>7} same",
    ]
    print(*lines, sep="\n", flush=True)
    for spec in args.tokenizers.split(","):
        name, tok = _load_tokenizer(spec)
        # the 8B shape's head: its vocabulary, or the tokenizer's where that is larger
        vocab = args.vocab_size or max(MODEL_SHAPES["llama-3.1-8b"]["vocab_size"], len(tok))
        for bname in args.backends.split(","):
            backend = get_backend(bname, tok, vocab_size=vocab)
            for batch in [int(b) for b in args.batches.split(",")]:
                for nodes in [int(n) for n in args.nodes.split(",")]:
                    r = bench(backend, batch, nodes, threads, args.reps, args.seed)
                    r.update(backend=bname, tokenizer=name, vocab_size=vocab)
                    res["rows"].append(r)
                    for v in r["variants"]:
                        line = (
                            f"{bname:>10} {name:>9} {batch:5d} {nodes:5d} {v['variant']:>11} "
                            f"{v['best_ms']:8.2f} {v['median_ms']:9.2f} {v['speedup']:6.2f} "
                            f"{v['us_per_row']:7.2f} {'yes' if v['rows_equal'] else 'NO'}"
                        )
                        lines.append(line)
                        print(line, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tree-fill.json").write_text(json.dumps(res, indent=1))
        (out / "tree-fill.md").write_text(
            "# Tree fill vs threads\n\n`python benchmarks/bench_tree_fill.py "
            + " ".join(os.sys.argv[1:])
            + "`\n\n```\n"
            + "\n".join(lines)
            + "\n```\n"
        )


if __name__ == "__main__":
    main()
