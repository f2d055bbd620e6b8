"""The CPU verify forward, side by side in one run (issues #23, #38): Hugging Face's forward
against our fused decoder (padding rows skipped) with its projections through oneDNN alone and
with the small-batch kernel (:mod:`spec_grammar.worker.decoder.cpu_gemm`, the default up to its
``MAX_ROWS``), and with attention through SDPA and through the CPU attention kernel
(:mod:`spec_grammar.worker.decoder.cpu_attention`, the default), per batch x tree shape; the
attention alone per shape (SDPA against the kernel, cache-cold: each of the model's layers its
own KV buffers, as in the runner's store); and the projections alone (``F.linear``'s MKL GEMM,
oneDNN, the kernel) over the model's own weights per row count.

SmolLM2-135M float32, each request with a 300-token context; per shape the median of
``--reps`` forwards, the two decoders alternating so that the host's load hits both alike.
Ragged shapes (trees of different sizes in one batch) show what skipping padding saves.

    .venv/bin/python benchmarks/bench_cpu_forward.py --threads 1 --out benchmarks/results/cpu-forward
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from spec_grammar.models import load_model
from spec_grammar.tree import DraftTree
from spec_grammar.worker.decoder import cpu_attention, cpu_gemm
from spec_grammar.worker.runner import ModelRunner

SHAPES = [[1], [4], [8], [16], [1] * 8, [4] * 8, [8, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8]]


def _chain(n: int) -> DraftTree:
    return DraftTree.chain(1000, list(range(1001, 1000 + n)))


def _onednn_only():
    """Projections through oneDNN at every row count (the kernel's row limit set to 0)."""
    return mock.patch.object(cpu_gemm, "MAX_ROWS", 0)


def _sdpa_only():
    """Attention through SDPA for every shape (the kernel's query limit set to 0)."""
    return mock.patch.object(cpu_attention, "MAX_QUERIES", 0)


def forwards(model, reps: int) -> list[dict]:
    runners = {"hf": ModelRunner(model, fused_forward=False), "onednn": ModelRunner(model)}
    runners["sdpa"] = runners["ours"] = runners["onednn"]
    patches = {"onednn": _onednn_only, "sdpa": _sdpa_only}
    rids = [f"r{i}" for i in range(8)]
    for name in ("hf", "onednn"):
        for rid in rids:
            runners[name].add(rid, list(range(200, 500)))
    rows = []
    for shape in SHAPES:
        trees = [_chain(n) for n in shape]
        times: dict[str, list[float]] = {k: [] for k in runners}
        for r in runners.values():
            r.forward_trees(rids[: len(shape)], trees)  # warm-up
        for _ in range(reps):
            for name, r in runners.items():
                with patches.get(name, contextlib.nullcontext)():
                    t = time.perf_counter()
                    r.forward_trees(rids[: len(shape)], trees)
                    times[name].append((time.perf_counter() - t) * 1e3)
        row = {"batch": len(shape), "nodes": sum(shape)}
        rows.append(row | {f"{k}_ms": statistics.median(v) for k, v in times.items()})
    return rows


def attention(model, reps: int) -> list[dict]:
    """Per shape, microseconds per layer of the fused forward's attention over 300-token
    contexts: SDPA over ``k_buf[rows, :, :kv_len]`` (rows a slice, as the runner passes
    ascending rows, and an index tensor) against the kernel, all layers in turn (each reads
    its own buffers from memory, as a forward does)."""
    cfg = model.config
    layers, heads, kv_heads = (
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    d, group, ctx = cfg.hidden_size // heads, heads // kv_heads, 300
    neg = torch.finfo(torch.float32).min
    store = torch.randn(layers, 2, 8, kv_heads, 512, d)
    rows = []
    for shape in SHAPES:
        b, n = len(shape), max(shape)
        kv = ctx + n
        q = [torch.randn(b, heads, n, d) for _ in range(layers)]
        allowed = torch.zeros(b, n, kv, dtype=torch.bool)
        allowed[:, :, :ctx] = True
        allowed[:, :, ctx:] = torch.ones(n, n, dtype=torch.bool).tril()  # chains (padded)
        mask = torch.zeros(b, 1, n, kv).masked_fill_(~allowed[:, None], neg)
        sdpa_mask = mask.repeat(1, 1, group, 1)
        queries = torch.tensor(shape)
        index = torch.arange(b - 1, -1, -1)

        def sdpa(i, sel):
            out = torch.nn.functional.scaled_dot_product_attention(
                q[i].view(b, kv_heads, group * n, d),
                store[i, 0, sel, :, :kv],
                store[i, 1, sel, :, :kv],
                attn_mask=sdpa_mask,
                scale=d**-0.5,
            )
            return out.reshape(b, heads, n, d).transpose(1, 2).reshape(b * n, -1)

        fns = {"sdpa": lambda i: sdpa(i, slice(0, b)), "sdpa_index": lambda i: sdpa(i, index)}
        if cpu_attention.available():
            at = cpu_attention.row_indices(slice(0, b), 8)
            fns["kernel"] = lambda i: cpu_attention.attention(
                q[i], store[i, 0], store[i, 1], at, kv, mask, d**-0.5, queries
            )
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.inference_mode():
            for _ in range(reps):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    for i in range(layers):
                        fn(i)
                    times[name].append((time.perf_counter() - t) * 1e6 / layers)
        row = {"batch": b, "nodes": sum(shape)}
        rows.append(row | {f"{k}_us": statistics.median(v) for k, v in times.items()})
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
    onednn = torch.ops.mkldnn._linear_pointwise
    fns = {
        "mkl": torch.nn.functional.linear,
        "onednn": lambda x, w, b: onednn(x, w, b, "none", [], ""),
        "kernel": cpu_gemm.linear if cpu_gemm.available() else None,
    }
    rows = []
    for m in (1, 2, 4, 8, 16, 24, 32):
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
        times: dict[str, list[float]] = {k: [] for k, fn in fns.items() if fn is not None}
        for _ in range(reps):
            for name in times:
                if name == "kernel" and m > cpu_gemm.MAX_ROWS:
                    continue
                t = time.perf_counter()
                with torch.inference_mode():
                    for w in weights:
                        fns[name](xs[w.shape[1]], w, None)
                times[name].append((time.perf_counter() - t) * 1e3)
        rows.append({"rows": m, **{k: statistics.median(v) for k, v in times.items() if v}})
    return rows


def _median_rows(runs: list[list[dict]]) -> list[dict]:
    """Cell by cell, the median of the runs' timings (the same rows in the same order; the
    shape columns, ints, kept)."""
    return [
        {
            k: v if isinstance(v, int) else statistics.median(row[k] for row in rows)
            for k, v in rows[0].items()
        }
        for rows in zip(*runs)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--runs", type=int, default=1, help="repeat everything, report cell medians")
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("smollm2")
    runs = [
        (forwards(model, args.reps), attention(model, args.reps), projections(model, args.reps))
        for _ in range(args.runs)
    ]
    fwd, attn, proj = (_median_rows([run[i] for run in runs]) for i in range(3))
    md = [
        f"SmolLM2-135M float32, {args.threads} thread(s), median of {args.reps}"
        + (f", median over {args.runs} runs" if args.runs > 1 else ""),
        "",
        "| batch | nodes | HF forward ms | ours, oneDNN ms | ours, SDPA ms | ours ms | HF / ours |"
        " oneDNN / ours | SDPA / ours | ours / one-token ours |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    one = fwd[0]["ours_ms"]
    for r in fwd:
        md.append(
            f"| {r['batch']} | {r['nodes']} | {r['hf_ms']:.1f} | {r['onednn_ms']:.1f} | "
            f"{r['sdpa_ms']:.1f} | {r['ours_ms']:.1f} | {r['hf_ms'] / r['ours_ms']:.2f}x | "
            f"{r['onednn_ms'] / r['ours_ms']:.2f}x | {r['sdpa_ms'] / r['ours_ms']:.2f}x | "
            f"{r['ours_ms'] / one:.2f} |"
        )
    md += [
        "",
        "| batch | nodes | SDPA us/layer | SDPA, index rows us/layer | kernel us/layer |"
        " SDPA / kernel |",
        "|---|---|---|---|---|---|",
    ]
    for r in attn:
        kernel = r.get("kernel_us")
        md.append(
            f"| {r['batch']} | {r['nodes']} | {r['sdpa_us']:.0f} | {r['sdpa_index_us']:.0f} | "
            + (f"{kernel:.0f} | {r['sdpa_us'] / kernel:.2f}x |" if kernel else "- | - |")
        )
    md += [
        "",
        "| rows | F.linear (MKL) ms | oneDNN ms | kernel ms | oneDNN / kernel |",
        "|---|---|---|---|---|",
    ]
    for r in proj:
        kernel = r.get("kernel")
        md.append(
            f"| {r['rows']} | {r['mkl']:.1f} | {r['onednn']:.1f} | "
            + (f"{kernel:.1f} | {r['onednn'] / kernel:.2f}x |" if kernel else "- | - |")
        )
    text = "\n".join(md)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(
            json.dumps({"forward": fwd, "attention": attn, "projections": proj})
        )
        Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
