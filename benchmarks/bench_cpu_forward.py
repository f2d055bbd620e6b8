"""The CPU verify forward, side by side in one run (issue #23): Hugging Face's forward against
our fused decoder (oneDNN projections, padding rows skipped), per batch x tree shape, and the
projections alone (``F.linear``'s MKL GEMM against :func:`spec_grammar.worker.decoder.ops.linear`
over the model's own weights) per row count.

SmolLM2-135M float32, each request with a 300-token context; per shape the median of
``--reps`` forwards, the two decoders alternating so that the host's load hits both alike.
Ragged shapes (trees of different sizes in one batch) show what skipping padding saves.

    .venv/bin/python benchmarks/bench_cpu_forward.py --threads 1 --out benchmarks/results/cpu-forward
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spec_grammar.models import load_model
from spec_grammar.tree import DraftTree
from spec_grammar.worker.decoder import ops
from spec_grammar.worker.runner import ModelRunner

SHAPES = [[1], [4], [8], [16], [1] * 8, [4] * 8, [8, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8]]


def _chain(n: int) -> DraftTree:
    return DraftTree.chain(1000, list(range(1001, 1000 + n)))


def forwards(model, reps: int) -> list[dict]:
    runners = {"hf": ModelRunner(model, fused_forward=False), "ours": ModelRunner(model)}
    rids = [f"r{i}" for i in range(8)]
    for r in runners.values():
        for rid in rids:
            r.add(rid, list(range(200, 500)))
    rows = []
    for shape in SHAPES:
        trees = [_chain(n) for n in shape]
        times: dict[str, list[float]] = {k: [] for k in runners}
        for r in runners.values():
            r.forward_trees(rids[: len(shape)], trees)  # warm-up
        for _ in range(reps):
            for name, r in runners.items():
                t = time.perf_counter()
                r.forward_trees(rids[: len(shape)], trees)
                times[name].append((time.perf_counter() - t) * 1e3)
        hf, ours = (statistics.median(times[k]) for k in ("hf", "ours"))
        rows.append({"batch": len(shape), "nodes": sum(shape), "hf_ms": hf, "ours_ms": ours})
    return rows


def projections(model, reps: int) -> list[dict]:
    layers = model.model.layers
    weights = [
        w
        for layer in layers
        for w in (
            layer.self_attn.q_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_proj.weight,
            layer.mlp.down_proj.weight,
        )
    ]
    rows = []
    for m in (1, 2, 4, 8, 16, 32):
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
        times: dict[str, list[float]] = {"mkl": [], "ours": []}
        for _ in range(reps):
            for name, fn in (("mkl", torch.nn.functional.linear), ("ours", ops.linear)):
                t = time.perf_counter()
                with torch.inference_mode():
                    for w in weights:
                        fn(xs[w.shape[1]], w, None)
                times[name].append((time.perf_counter() - t) * 1e3)
        rows.append({"rows": m, **{k: statistics.median(v) for k, v in times.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("smollm2")
    fwd, proj = forwards(model, args.reps), projections(model, args.reps)
    md = [
        f"SmolLM2-135M float32, {args.threads} thread(s), median of {args.reps}",
        "",
        "| batch | nodes | HF forward ms | ours ms | HF / ours | ours / one-token ours |",
        "|---|---|---|---|---|---|",
    ]
    one = fwd[0]["ours_ms"]
    for r in fwd:
        md.append(
            f"| {r['batch']} | {r['nodes']} | {r['hf_ms']:.1f} | {r['ours_ms']:.1f} | "
            f"{r['hf_ms'] / r['ours_ms']:.2f}x | {r['ours_ms'] / one:.2f} |"
        )
    md += ["", "| rows | F.linear (MKL) ms | ops.linear ms | MKL / ours |", "|---|---|---|---|"]
    for r in proj:
        md.append(
            f"| {r['rows']} | {r['mkl']:.1f} | {r['ours']:.1f} | {r['mkl'] / r['ours']:.2f}x |"
        )
    text = "\n".join(md)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"forward": fwd, "projections": proj}))
        Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
