"""Verify-forward time of one model three ways, side by side: Hugging Face's forward under CUDA
graphs, our fused decoder (``spec_grammar.worker.decoder``) under CUDA graphs, and the fused
decoder eagerly, against the time to read the weights once (issue #6: the Llama-3.1-8B shape at
batch 1 within 1.5x of it).

Random bf16 weights of a :data:`spec_grammar.testing.model_shapes.MODEL_SHAPES` shape (timings
do not depend on values); each request has a ``--prompt``-token prefix and verifies a tree of
``--nodes`` nodes (a chain); median of ``--reps`` synchronized ``forward_trees`` after 3 warm-up
forwards (graph capture). With ``--profile`` the kernel count and GPU time split of one fused
and one HF graph replay are printed (torch.profiler). Needs CUDA.

    python benchmarks/bench_decoder.py --shape llama-3.1-8b --batches 1,8,32 --nodes 1,8,64
"""

from __future__ import annotations

import argparse
import collections

import torch
from spec_grammar_bench.gpu import _copy_bandwidth, _forward_ms

from spec_grammar.testing.model_shapes import build_model
from spec_grammar.tree import DraftTree
from spec_grammar.worker.runner import ModelRunner


def chain(n: int) -> DraftTree:
    return DraftTree(list(range(5, 5 + n)), [-1] + list(range(n - 1)))


def profile(runner: ModelRunner, batch: int, nodes: int, prompt: int) -> str:
    """Kernel count and the largest GPU-time groups of one forward."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rids = [f"p{i}" for i in range(batch)]
    for rid in rids:
        runner.add(rid, list(range(100, 100 + prompt)))
    try:
        for _ in range(3):
            runner.forward_trees(rids, [chain(nodes)] * batch)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.forward_trees(rids, [chain(nodes)] * batch)
            torch.cuda.synchronize()
    finally:
        for rid in rids:
            runner.remove(rid)
    groups: collections.Counter = collections.Counter()
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            name = e.name.lower()
            kind = (
                "gemm"
                if any(k in name for k in ("gemm", "gemv", "cutlass", "sm90", "nvjet"))
                else ("attention" if "attention" in name or "fmha" in name else name[:40])
            )
            groups[kind] += e.device_time_total
    top = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in groups.most_common(6))
    return f"{count} kernels; {top}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--nodes", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decoder needs CUDA")
    dev = torch.device("cuda")
    model = build_model(args.shape, dev, torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_ms = weight_bytes / _copy_bandwidth(dev) * 1e3
    runners = {
        "hf graphs": ModelRunner(model, fused_forward=False, cuda_graphs=True),
        "fused graphs": ModelRunner(model, fused_forward=True, cuda_graphs=True),
        "fused eager": ModelRunner(model, fused_forward=True, cuda_graphs=False),
    }
    print(
        f"{args.shape}: {weight_bytes / 1e9:.2f} GB of weights, weight-read {read_ms:.2f} ms "
        f"({torch.cuda.get_device_name(dev)}, torch {torch.__version__})"
    )
    print(
        f"| B | nodes | {' | '.join(runners)} | hf / fused (graphs) | fused graphs / weight-read |"
    )
    print("|---|---|" + "---|" * (len(runners) + 2))
    for b in (int(x) for x in args.batches.split(",")):
        for n in (int(x) for x in args.nodes.split(",")):
            ms = {
                k: _forward_ms(r, chain(n), b, args.prompt, args.reps) for k, r in runners.items()
            }
            print(
                f"| {b} | {n} | "
                + " | ".join(f"{v:.2f}" for v in ms.values())
                + f" | {ms['hf graphs'] / ms['fused graphs']:.2f}x | {ms['fused graphs'] / read_ms:.2f}x |",
                flush=True,
            )
    if args.profile:
        for k in ("hf graphs", "fused graphs"):
            print(f"profile {k}, B=1, 8 nodes: {profile(runners[k], 1, 8, args.prompt)}")


if __name__ == "__main__":
    main()
