"""``spec-grammar bench e2e``: end to end, ours against HF ``generate`` + a grammar processor
(registered into :data:`spec_grammar.cli.bench.BENCHMARKS`)."""

from __future__ import annotations

import argparse

from .bench import _csv, bench_module, check_output_path, config_errors


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _limits(text: str):
    """``--output-limits`` text as OutputLimits: ``default`` or ``name=N,...``. Raises
    ValueError naming the bad part."""
    from pydantic import ValidationError

    from ..json_schema.limits import DEFAULT_OUTPUT_LIMITS, LIMIT_FIELDS, OutputLimits
    from ..worker.request import one_line

    if text.strip() == "default":
        return DEFAULT_OUTPUT_LIMITS
    values = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = part.partition("=")
        if name not in LIMIT_FIELDS or not value.strip().isdigit():
            raise ValueError(
                f"--output-limits: {part!r} is not NAME=N with NAME one of {', '.join(LIMIT_FIELDS)}"
            )
        values[name] = int(value)
    try:
        return OutputLimits(**values)
    except ValidationError as e:
        raise ValueError(f"--output-limits {text!r}: {one_line(e)}") from None


def register_e2e(sub) -> None:
    """Add the ``e2e`` parser to the ``bench`` subparsers."""
    p = sub.add_parser(
        "e2e",
        help="end to end on a real model: ours (spec / no spec / unconstrained) vs HF generate + grammar processor",
        description="Writes e2e.json, e2e.md and PNG plots into --out. Greedy, CPU, the same prompts for every row.",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 schema + 1 BFCL case, 8 new tokens, xgrammar",
    )
    p.add_argument(
        "--backends",
        type=_csv,
        default=None,
        help="our backends, comma list (default: every registered one with JSON Schema and tool calls)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive,
        default=None,
        help="token limit per output (default 128)",
    )
    p.add_argument(
        "--schemas",
        type=int,
        default=None,
        help="JSONSchemaBench schemas (default 12, spread over subsets)",
    )
    p.add_argument("--bfcl", type=int, default=None, help="BFCL tool-call cases (default 8)")
    p.add_argument(
        "--hf-processors", type=_csv, default=None, help="xgrammar,llguidance (default both)"
    )
    p.add_argument(
        "--hf-speculation",
        type=_csv,
        default=None,
        help="HF rows: none,prompt_lookup,assistant (default all three)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of generation after which no new prompt starts (default: none)",
    )
    p.add_argument(
        "--skip-rows",
        type=_csv,
        default=None,
        help="row ids to leave out, e.g. hf/llguidance+assist",
    )
    p.add_argument(
        "--output-limits",
        action="append",
        default=None,
        metavar="LIMITS",
        help="one more row per backend with these output limits: 'default' (the library's "
        "DEFAULT_OUTPUT_LIMITS) or e.g. 'max_items=8,max_string_length=128' (repeatable)",
    )
    p.add_argument("--model", default=None, help="model name or path (default smollm2)")
    p.add_argument(
        "--threads", type=_positive, default=None, help="torch intra-op threads (default 1)"
    )
    p.add_argument(
        "--docs",
        default=None,
        help="also regenerate this Markdown page from --out (e.g. docs/benchmarks.md)",
    )
    p.set_defaults(func=_run_e2e)


def _run_e2e(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    e2e, e2e_report = bench_module("e2e"), bench_module("e2e_report")
    E2EBenchConfig, run_e2e = e2e.E2EBenchConfig, e2e.run_e2e
    goal_ratios, write_e2e_report = e2e_report.goal_ratios, e2e_report.write_e2e_report
    write_docs = bench_module("report").write_docs

    overrides = dict(
        backends=args.backends,
        max_new_tokens=args.max_new_tokens,
        jsb_cases=args.schemas,
        bfcl_cases=args.bfcl,
        hf_processors=args.hf_processors,
        hf_speculation=args.hf_speculation,
        model=args.model,
        torch_threads=args.threads,
        skip_rows=args.skip_rows,
        time_budget_s=args.time_budget,
        output_limits=None
        if args.output_limits is None
        else [_limits(text) for text in args.output_limits],
    )
    bad = [s for s in args.hf_speculation or [] if s not in ("none", "prompt_lookup", "assistant")]
    if bad:
        raise ValueError(f"unknown --hf-speculation {bad}: use none, prompt_lookup, assistant")
    flags = {
        "jsb_cases": "--schemas",
        "bfcl_cases": "--bfcl",
        "torch_threads": "--threads",
        "time_budget_s": "--time-budget",
    }
    with config_errors(overrides, flags):
        if args.quick:
            cfg = E2EBenchConfig.quick(**overrides)
        else:
            cfg = E2EBenchConfig(**{k: v for k, v in overrides.items() if v is not None})
    check_output_path(args.out, "--out")
    check_output_path(args.docs, "--docs", directory=False)
    console = Console()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        res = run_e2e(cfg, report)
    paths = write_e2e_report(res, args.out)
    if args.docs:
        paths["docs"] = write_docs([args.out], args.docs, replot=False)
    _print_summary(console, res, goal_ratios(res))
    for kind, path in paths.items():
        console.print(f"{kind}: {path}")
    return 0


def _print_summary(console, res, goals) -> None:
    from rich.table import Table

    table = Table(title="end to end (sums over prompts)")
    for col in (
        "row",
        "tokens/s",
        "accept length",
        "valid / completed",
        "cut",
        "failed",
        "same as HF + xgrammar",
    ):
        table.add_column(col)
    for s in res["summary"]:
        table.add_row(
            s["label"],
            f"{s['tokens_per_s']:.2f}" if s["tokens_per_s"] else "–",
            f"{s['accept_length']:.2f}" if s["accept_length"] else "–",
            f"{s['valid']}/{s['completed']}",
            str(s["cut"]),
            f"{s['errors']}/{s['prompts']}",
            f"{s['identical']}/{s['compared']}" if s["compared"] else "–",
        )
    console.print(table)
    for g in goals:
        x = {k: f"{v:.2f}x" if v else "–" for k, v in g.items() if k.startswith("vs_")}
        console.print(
            f"{g['row']}: {x['vs_hf']} HF + xgrammar ({x['vs_hf_decode']} decode only), "
            f"{x['vs_unconstrained']} unconstrained spec ({x['vs_unconstrained_decode']} decode only)"
        )
