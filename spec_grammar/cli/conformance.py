"""``spec-grammar conformance``: run the backend-conformance suite on any backend, or compare
backends on the JSON-Schema-Test-Suite.

Exit code 0 when every property passes (or is skipped), 1 on any failure, 2 on bad usage.
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the backend-conformance suite",
        description="Run the conformance properties on a backend (registered name or module:Class). "
        "A failure names the contract, the input, and the expected and actual allowed sets.",
    )
    p.add_argument("--backend", metavar="NAME|module:Class", help="backend to test")
    p.add_argument(
        "--tokenizer",
        action="append",
        choices=["toy", "smollm2"],
        help="fixture tokenizer(s) to run on (default: both; repeatable)",
    )
    p.add_argument("--quick", action="store_true", help="toy tokenizer only (a few seconds)")
    p.add_argument(
        "--slow", action="store_true", help="long mode: 8x random examples, whole data sets"
    )
    p.add_argument(
        "--property", action="append", metavar="NAME", help="run only this property (repeatable)"
    )
    p.add_argument("--seed", type=int, help="random seed (default: the same examples every run)")
    p.add_argument("--list", action="store_true", help="list the properties and exit")
    p.add_argument(
        "--compare",
        metavar="A,B,...",
        help="instead: which JSON-Schema-Test-Suite instances each backend accepts, differences only",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..testing import resolve_factory, run_conformance, select_properties

    if args.compare:
        return _compare(args)
    fixtures = ["toy"] if args.quick else (args.tokenizer or ["toy", "smollm2"])
    if args.list:
        for prop in select_properties(fixtures):
            print(f"{prop.name}  [{prop.fixture}]  {prop.contract}")
        return 0
    if not args.backend:
        print(
            "spec-grammar conformance: error: give --backend NAME (or --compare / --list)",
            file=sys.stderr,
        )
        return 2
    factory = resolve_factory(args.backend)
    results = run_conformance(
        factory, fixtures=fixtures, names=args.property, slow=args.slow, seed=args.seed
    )
    failed = [r for r in results if r.status in ("FAIL", "ERROR")]
    if args.json:
        report = {
            "backend": args.backend,
            "passed": not failed,
            "results": [r.to_dict() for r in results],
        }
        print(json.dumps(report, indent=2))
        return 1 if failed else 0
    _print_results(args.backend, results)
    return 1 if failed else 0


def _print_results(backend: str, results) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    style = {"PASS": "green", "FAIL": "red", "ERROR": "red", "SKIP": "yellow"}
    table = Table(title=f"spec-grammar conformance: {backend}")
    for col in ("property", "tokenizer", "result", "seconds"):
        table.add_column(col)
    for r in results:
        table.add_row(r.name, r.fixture, f"[{style[r.status]}]{r.status}[/]", f"{r.seconds:.2f}")
    console.print(table)
    for r in results:
        if r.status in ("FAIL", "ERROR", "SKIP"):
            console.print(f"[{style[r.status]}]{r.status}[/] {r.name}")
            console.print(escape(r.detail), highlight=False)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
    console.print(", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n))


def _compare(args) -> int:
    from ..registry import get_backend
    from ..testing.fixtures import fixture_tokenizer
    from ..testing.json_suite import acceptance, compare_backends, format_table, suite_cases

    names = [n for n in args.compare.split(",") if n]
    tok, width = fixture_tokenizer("smollm2")
    cases = suite_cases(args.slow)
    outcomes = {name: acceptance(get_backend(name, tok, vocab_size=width), cases) for name in names}
    rows = compare_backends(outcomes, cases)
    if args.json:
        print(json.dumps({"cases": len(cases), "differences": rows}, indent=2))
    else:
        print(
            f"{len(cases)} instances; {len(rows)} where a backend differs from jsonschema or another backend"
        )
        print(format_table(rows, names))
    return 0
