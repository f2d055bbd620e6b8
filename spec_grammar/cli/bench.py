"""``spec-grammar bench``: benchmarks, one subcommand each (``masks``, ``e2e``, ``gpu``,
``report``, registered through :data:`BENCHMARKS`).

The benchmarks are not part of the core library: they live in the ``spec_grammar_bench``
package (``benchmarks/spec_grammar_bench/`` in the source tree, installed with the
distribution), imported only when a subcommand runs (:func:`bench_module`), so ``spec-grammar
--help`` and the parsers never load it."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from ..errors import SpecGrammarError


class BenchUnavailableError(SpecGrammarError):
    """The benchmark package, or a library its reports need (matplotlib), is not installed."""


def bench_module(name: str, *, plots: bool = True) -> ModuleType:
    """``spec_grammar_bench.<name>``, imported on use. Raises :class:`BenchUnavailableError`
    naming what to install when the package is missing, or (``plots``: the command writes PNG
    plots) when matplotlib is, before any work starts."""
    try:
        module = importlib.import_module(f"spec_grammar_bench.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("spec_grammar_bench", f"spec_grammar_bench.{name}"):
            raise  # something the benchmark itself imports: its own message names it
        raise BenchUnavailableError(
            "the benchmark package spec_grammar_bench is not installed: it ships with "
            "spec-grammar's source tree (benchmarks/spec_grammar_bench); install spec-grammar "
            "from a checkout with the bench extra (pip install -e '.[bench]'), or put the "
            "checkout's benchmarks/ folder on PYTHONPATH"
        ) from None
    if plots:
        try:
            importlib.import_module("matplotlib")
        except ImportError as e:
            raise BenchUnavailableError(
                f"the benchmark reports need matplotlib for their plots ({e}): pip install "
                "'spec-grammar[bench]' (or pip install matplotlib)"
            ) from None
    return module


def check_output_path(path: str | None, flag: str, *, directory: bool = True) -> None:
    """Make the output directory ``path`` (``flag``'s value), or the folder of the output file
    ``path`` (``directory=False``: ``--docs``), now, before any work: raise ValueError in one
    line when it cannot be (a file in the way, a directory given for a file, a folder that is
    not writable), rather than when the report is written at the end of the run."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir() != directory and p.exists():
        what = "a file, not a directory" if directory else "a directory, not a file"
        raise ValueError(f"{flag} {path} is {what}")
    folder = p if directory else p.parent
    for up in (folder, *folder.parents):
        if up.exists() and not up.is_dir():
            raise ValueError(f"{flag} {path}: {up} is a file, not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create {folder}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {folder} is not writable")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


@contextlib.contextmanager
def config_errors(overrides: dict, flags: dict[str, str]):
    """Turn a benchmark config's pydantic ``ValidationError`` into a ValueError in one line
    naming each bad flag (``flags``: config field -> flag where the names differ, the others
    ``--`` + the field with ``-`` for ``_``); ``main`` prints it and exits 2."""
    import pydantic

    try:
        yield
    except pydantic.ValidationError as e:
        parts = []
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            flag = flags.get(field, f"--{field.replace('_', '-')}") if field in overrides else field
            msg = err["msg"].removeprefix("Value error, ")
            got = "" if err["type"] == "value_error" else f" (got {err['input']!r})"
            parts.append(f"{flag}: {msg}{got}")
        raise ValueError("; ".join(parts)) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _register_masks(sub) -> None:
    p = sub.add_parser(
        "masks",
        help="compile time of real schemas and draft-tree bitmask fill cost, ours vs naive",
        description="Writes masks.json, masks.md and PNG plots into --out.",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small smoke run (tens of seconds per backend and tokenizer)",
    )
    p.add_argument(
        "--tokenizers", type=_csv, default=None, help="comma list (default smollm2,gemma3)"
    )
    p.add_argument(
        "--backends", type=_csv, default=None, help="comma list (default: every registered backend)"
    )
    p.add_argument("--sizes", type=_ints, default=None, help="tree sizes N (default 8,16,64)")
    p.add_argument(
        "--requests", type=_ints, default=None, help="requests per batch (default 1,16,64)"
    )
    p.add_argument(
        "--threads", type=_ints, default=None, help="thread counts for ours (default 1,2)"
    )
    p.add_argument("--reps", type=int, default=None, help="warm repetitions per tree (default 20)")
    p.add_argument(
        "--compile-cases", type=int, default=None, help="cases per source to compile (default all)"
    )
    p.add_argument(
        "--compile-timeout",
        type=float,
        default=None,
        help="seconds per compile before it is killed",
    )
    p.add_argument(
        "--compile-budget",
        type=float,
        default=None,
        help="compile seconds per backend, tokenizer and source",
    )
    p.add_argument(
        "--docs", default=None, help="also regenerate this Markdown page (e.g. docs/benchmarks.md)"
    )
    p.set_defaults(func=_run_masks)


def _run_masks(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    masks = bench_module("masks")
    MaskBenchConfig, run_masks = masks.MaskBenchConfig, masks.run_masks
    write_masks_report = bench_module("masks_report").write_masks_report
    write_docs = bench_module("report").write_docs

    overrides = dict(
        tokenizers=args.tokenizers,
        backends=args.backends,
        sizes=args.sizes,
        requests=args.requests,
        threads=args.threads,
        reps=args.reps,
        compile_cases_per_source=args.compile_cases,
        compile_timeout_s=args.compile_timeout,
        compile_budget_s=args.compile_budget,
    )
    flags = {
        "compile_cases_per_source": "--compile-cases",
        "compile_timeout_s": "--compile-timeout",
        "compile_budget_s": "--compile-budget",
    }
    with config_errors(overrides, flags):
        if args.quick:
            cfg = MaskBenchConfig.quick(**overrides)
        else:
            cfg = MaskBenchConfig(**{k: v for k, v in overrides.items() if v is not None})
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

        # a crash in a later tokenizer keeps the finished ones on disk
        res = run_masks(
            cfg, report, on_partial=lambda partial: write_masks_report(partial, args.out)
        )
    paths = write_masks_report(res, args.out)
    if args.docs:
        paths["docs"] = write_docs([args.out], args.docs, replot=False)
    _print_summary(console, res)
    for kind, path in paths.items():
        console.print(f"{kind}: {path}")
    return 1 if res["problems"] else 0


def _print_summary(console, res) -> None:
    from rich.table import Table

    summary_rows = bench_module("masks_report").summary_rows

    sizes = sorted({r["nodes"] for r in res["trees"]})
    table = Table(title="tree-mask cost (ours, 1 request, 1 thread)")
    for col in (
        ["backend", "tokenizer", "compile median ms"]
        + [f"µs/node N={n}" for n in sizes]
        + ["speedup vs naive"]
    ):
        table.add_column(col)
    for row in summary_rows(res):
        table.add_row(*row)
    console.print(table)
    for p in res["problems"]:
        console.print(f"[red]check failed:[/red] {p}")


def _register_report(sub) -> None:
    p = sub.add_parser(
        "report",
        help="regenerate reports and docs/benchmarks.md from result JSON files",
        description="Reads every benchmark JSON in the --from directories; rewrites their Markdown "
        "reports and plots, and the --docs page.",
    )
    p.add_argument(
        "--from",
        dest="from_dirs",
        action="append",
        required=True,
        help="results directory (repeatable)",
    )
    p.add_argument(
        "--docs",
        default="docs/benchmarks.md",
        help="Markdown page to write (default docs/benchmarks.md)",
    )
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    check_output_path(args.docs, "--docs", directory=False)
    path = bench_module("report").write_docs(args.from_dirs, args.docs)
    print(f"wrote {path}")
    return 0


from .bench_e2e import register_e2e  # noqa: E402  (it reuses this module's helpers)
from .bench_gpu import register_gpu  # noqa: E402

BENCHMARKS: dict[str, Callable] = {
    "masks": _register_masks,
    "e2e": register_e2e,
    "gpu": register_gpu,
    "report": _register_report,
}
"""Subcommand name -> ``register(subparsers)``; a new benchmark adds itself here."""


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON + Markdown + plots)")
    bench_sub = p.add_subparsers(dest="benchmark", required=True)
    for add in BENCHMARKS.values():
        add(bench_sub)
