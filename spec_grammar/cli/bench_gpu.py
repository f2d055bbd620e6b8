"""``spec-grammar bench gpu``: step time of the speculative worker on a GPU with and without
grammar, overlap on and off (registered into :data:`spec_grammar.cli.bench.BENCHMARKS`)."""

from __future__ import annotations

from .bench import _csv, _ints


def register_gpu(sub) -> None:
    """Add the ``gpu`` parser to the ``bench`` subparsers."""
    p = sub.add_parser(
        "gpu",
        help="GPU step time: no grammar vs grammar with / without overlap (random-weight 8B and 135M targets)",
        description="Writes <name>.json and <name>.md into --out (default benchmarks/results/gpu-h200.*).",
    )
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument("--name", default="gpu-h200", help="file name stem (default gpu-h200)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: 2-layer model, batch 1 and 2")
    p.add_argument("--models", type=_csv, default=None, help="llama-3.1-8b,smollm2-135m (default both)")
    p.add_argument("--batches", type=_ints, default=None, help="batch sizes (default 1,8,32)")
    p.add_argument("--nodes", type=_ints, default=None, help="draft tree sizes, root included (default 8,16)")
    p.add_argument("--cases", type=int, default=None, help="schemas (valid documents) per model (default 2)")
    p.add_argument("--accept-rate", type=float, default=None, help="drafter per-token accept rate (default 0.8)")
    p.add_argument("--budget", type=float, default=None, help="seconds after which no new configuration starts")
    p.add_argument("--device", default=None, help="torch device (default cuda)")
    p.add_argument("--tokenizer", default=None, help="smollm2 (default) or a directory with its tokenizer.json")
    p.set_defaults(func=_run_gpu)


def _run_gpu(args) -> int:
    from ..bench.gpu import GpuBenchConfig, run_gpu_bench, write_gpu_report

    overrides = dict(models=args.models, batches=args.batches, nodes=args.nodes, cases=args.cases,
                     accept_rate=args.accept_rate, budget_s=args.budget, device=args.device,
                     tokenizer=args.tokenizer)
    if args.quick:
        cfg = GpuBenchConfig.quick(**overrides)
    else:
        cfg = GpuBenchConfig(**{k: v for k, v in overrides.items() if v is not None})

    def partial(res: dict) -> None:  # a crash or time-out keeps the finished rows on disk
        write_gpu_report(res, args.out, args.name)

    res = run_gpu_bench(cfg, progress=lambda msg: print(msg, flush=True), on_partial=partial)
    for kind, path in write_gpu_report(res, args.out, args.name).items():
        print(f"{kind}: {path}")
    for p in res["problems"]:
        print(f"check failed: {p}")
    return 1 if res["problems"] else 0
