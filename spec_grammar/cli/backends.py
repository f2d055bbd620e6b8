"""``spec-grammar backends``: registered backends, versions and capabilities."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("backends", help="list registered grammar backends")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..registry import list_backends

    infos = list_backends()
    if args.json:
        print(json.dumps([i.model_dump(mode="json") for i in infos], indent=2))
        return 0
    table = Table(title="spec-grammar backends")
    for col in ("name", "target", "version", "grammars"):
        # fold, not "…": a cut entry-point target cannot be copied into --backend
        table.add_column(col, overflow="fold")
    for i in infos:
        if i.error:
            table.add_row(i.name, i.target, "-", f"[red]{escape(i.error)}[/red]")
            continue
        grammars = [k for k, v in i.capabilities.model_dump().items() if v]
        table.add_row(i.name, i.target, i.version or "?", ", ".join(grammars))
    # auto is no entry point: it routes over the rows above (docs/routing.md)
    table.add_row(
        "auto",
        "spec_grammar.routing:AutoBackend",
        "-",
        "per request: the backend above that enforces the most of it, then the fastest",
    )
    Console().print(table)
    return 0
