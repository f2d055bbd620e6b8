"""``spec-grammar bench gpu``: step time of the speculative worker on a GPU with and without
grammar, overlap on and off, CUDA graphs on and off (registered into
:data:`spec_grammar.cli.bench.BENCHMARKS`)."""

from __future__ import annotations

import argparse

from .bench import _csv, _ints, bench_module, check_output_path


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def register_gpu(sub) -> None:
    """Add the ``gpu`` parser to the ``bench`` subparsers."""
    p = sub.add_parser(
        "gpu",
        help="GPU step time: no grammar vs grammar with / without overlap (8B-shaped and real SmolLM2 targets)",
        description="Writes <name>.json, <name>.md, <name>-step.png and <name>-ratio.png into --out "
        "(default benchmarks/results; --name gives the file stem). Recipe for a GPU machine: scripts/gpu/README.md.",
    )
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument(
        "--name",
        default=None,
        help="file name stem (default gpu-<GPU model>, e.g. gpu-h200; gpu-quick with --quick, gpu-cpu off CUDA)",
    )
    p.add_argument(
        "--quick", action="store_true", help="CPU smoke run: 2-layer model, batch 1 and 2"
    )
    p.add_argument(
        "--models",
        type=_csv,
        default=None,
        help="llama-3.1-8b (random weights, Llama-3.1-8B shape), smollm2-135m-real (SmolLM2-135M-Instruct's "
        "real weights, see --weights), smollm2-135m (random weights, SmolLM2 shape) (default "
        "llama-3.1-8b,smollm2-135m-real)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="smollm2-135m-real weights: a .gguf file, a model directory or a known name (default smollm2)",
    )
    p.add_argument(
        "--tokenizers",
        type=_csv,
        default=None,
        help="smollm2, gemma3 or NAME=DIR with DIR/tokenizer.json (default smollm2,gemma3)",
    )
    p.add_argument("--batches", type=_ints, default=None, help="batch sizes (default 1,8,32)")
    p.add_argument(
        "--nodes",
        type=_ints,
        default=None,
        help="draft tree sizes, root included (default 8,16,64)",
    )
    p.add_argument(
        "--cases",
        type=int,
        default=None,
        help="schemas (valid documents) per tokenizer (default 2)",
    )
    p.add_argument(
        "--accept-rate",
        type=float,
        default=None,
        help="drafter per-token accept rate (default 0.8)",
    )
    p.add_argument(
        "--cuda-graphs",
        type=_on_off,
        default=None,
        help="on/off for the main modes (default on for CUDA; on is refused for a non-CUDA --device, "
        "where no graphs are captured)",
    )
    p.add_argument(
        "--fused-forward",
        type=_on_off,
        default=None,
        help="on/off: our fused decoder instead of the model's HF forward (default on where the runner "
        "supports it: CUDA with Triton, Llama-family models)",
    )
    p.add_argument(
        "--grammar-threads", type=int, default=None, help="the worker's grammar threads (default 1)"
    )
    p.add_argument(
        "--fill-threads",
        type=int,
        default=None,
        help="the grammar backend's num_threads: threads of one batched tree fill (default: the "
        "backend's)",
    )
    p.add_argument(
        "--distinct",
        action="store_const",
        const=True,
        default=None,
        help="every request of a batch writes its own schema's document (default: all one)",
    )
    p.add_argument(
        "--lazy-grammar",
        type=_on_off,
        default=None,
        help="on/off: verify greedy requests without tree fills in the overlapped modes (default: the "
        "worker's choice from measured times)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=None,
        help="most prompt tokens one prefill forward takes, over several requests (default: the "
        "runner's, 8192; the prompt length, 64 by default, prefills one request per forward)",
    )
    p.add_argument(
        "--eager-batches",
        type=_ints,
        default=None,
        help="batch sizes that also run grammar + overlap with CUDA graphs off (default 1)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="runs per mode, steps pooled (default 1)"
    )
    p.add_argument(
        "--cooldown",
        type=float,
        default=None,
        help="seconds the GPU idles before each run (default 0.5; 0 = none). The pause is never longer "
        "than the run before it took. Why: a busy GPU lowers its clock to stay within its power limit, "
        "so without a pause each mode would run slower for the mode that ran just before it",
    )
    p.add_argument(
        "--budget", type=float, default=None, help="seconds after which no new configuration starts"
    )
    p.add_argument("--device", default=None, help="torch device (default cuda)")
    p.set_defaults(func=_run_gpu)


_FLAGS = {"budget_s": "--budget", "cooldown_s": "--cooldown"}
"""Config field -> CLI flag where the names differ (the others: ``--`` + the field, ``-`` for ``_``)."""


def _config(args):
    """The :class:`GpuBenchConfig` of the flags. Raises ValueError in one line naming each bad
    flag (``main`` prints it and exits 2), before any model or tokenizer loads; a CUDA device
    on a machine without it is refused here too."""
    import pydantic
    import torch

    GpuBenchConfig = bench_module("gpu", plots=False).GpuBenchConfig

    overrides = dict(
        models=args.models,
        weights=args.weights,
        tokenizers=args.tokenizers,
        batches=args.batches,
        nodes=args.nodes,
        cases=args.cases,
        accept_rate=args.accept_rate,
        cuda_graphs=args.cuda_graphs,
        fused_forward=args.fused_forward,
        grammar_threads=args.grammar_threads,
        fill_threads=args.fill_threads,
        distinct=args.distinct,
        lazy_grammar=args.lazy_grammar,
        prefill_tokens=args.prefill_tokens,
        eager_batches=args.eager_batches,
        repeats=args.repeats,
        cooldown_s=args.cooldown,
        budget_s=args.budget,
        device=args.device,
    )
    try:
        if args.quick:
            cfg = GpuBenchConfig.quick(**overrides)
        else:
            cfg = GpuBenchConfig(**{k: v for k, v in overrides.items() if v is not None})
    except pydantic.ValidationError as e:
        parts = []
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            flag = (
                _FLAGS.get(field, f"--{field.replace('_', '-')}") if field in overrides else field
            )
            msg = err["msg"].removeprefix("Value error, ")
            got = "" if err["type"] == "value_error" else f" (got {err['input']!r})"
            parts.append(f"{flag}: {msg}{got}")
        raise ValueError("; ".join(parts)) from None
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {cfg.device}: CUDA is not available here (--quick or --device cpu runs on the CPU)"
        )
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        raise ValueError(
            f"--device {cfg.device}: only {torch.cuda.device_count()} CUDA device(s) here"
        )
    return cfg


def _run_gpu(args) -> int:
    cfg = _config(args)
    check_output_path(args.out, "--out")
    run_gpu_bench = bench_module("gpu").run_gpu_bench
    write_gpu_report = bench_module("gpu_report").write_gpu_report
    cuda = "cuda" in cfg.device
    if args.name:
        name = args.name
    elif args.quick or not cuda:
        name = "gpu-quick" if args.quick else "gpu-cpu"
    else:
        import torch

        name = default_name(torch.cuda.get_device_name(cfg.device))
    smoke = (
        "SMOKE RUN off CUDA: it checks that the bench runs end to end; "
        "its times and verdicts say nothing about a GPU"
    )
    if not cuda:
        print(smoke, flush=True)

    def partial(res: dict) -> None:  # a crash or time-out keeps the finished rows on disk
        write_gpu_report(res, args.out, name, plots=False)

    res = run_gpu_bench(cfg, progress=lambda msg: print(msg, flush=True), on_partial=partial)
    for kind, path in write_gpu_report(res, args.out, name).items():
        print(f"{kind}: {path}")
    for p in res["problems"]:
        print(f"check failed: {p}")
    if not cuda:
        print(smoke)
    return 1 if res["problems"] else 0


def default_name(gpu_name: str) -> str:
    """File stem for a GPU's results: ``gpu-`` + its model, e.g. ``gpu-h200`` for "NVIDIA
    H200", ``gpu-rtx-4090`` for "NVIDIA GeForce RTX 4090"; ``gpu-cuda`` for an empty name."""
    import re

    words = [
        w
        for w in re.split(r"[^a-z0-9]+", gpu_name.lower())
        if w and w not in ("nvidia", "geforce", "tesla")
    ]
    return "gpu-" + "-".join(words) if words else "gpu-cuda"
