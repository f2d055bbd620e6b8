"""``spec-grammar backends``: registered backends, versions and capabilities.

The listing imports no backend (:func:`~spec_grammar.backend_info.declared_backends`: entry
points, metadata and the adapters' source); ``--check`` imports each one and checks its class,
as ``--backend`` does before a run."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser(
        "backends",
        help="list registered grammar backends",
        description="List the registered grammar backends with their library version and the "
        "grammar kinds they declare, read without importing them (well under a second); "
        "--check imports each backend and checks it.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--check",
        "--verbose",
        action="store_true",
        help="import each backend and check its class (its library loads: seconds each)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if args.check:
        from ..registry import list_backends

        infos = list_backends()
    else:
        from ..backend_info import declared_backends

        infos = declared_backends()
    if args.json:
        print(json.dumps([i.model_dump(mode="json") for i in infos], indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="spec-grammar backends" + ("" if args.check else " (declared)"))
    for col in ("name", "target", "version", "grammars"):
        # fold, not "…": a cut entry-point target cannot be copied into --backend
        table.add_column(col, overflow="fold")
    for i in infos:
        if i.error:
            table.add_row(i.name, i.target, i.version or "-", f"[red]{escape(i.error)}[/red]")
            continue
        table.add_row(i.name, i.target, i.version or "?", escape(_grammars(i.capabilities)))
    # auto is no entry point: it routes over the rows above (docs/routing.md)
    table.add_row(
        "auto",
        "spec_grammar.routing:AutoBackend",
        "-",
        "per request: the backend above that enforces the most of the spec, then the fastest",
    )
    console = Console()
    console.print(table)
    if not args.check and any(i.capabilities is None and not i.error for i in infos):
        console.print("?: not declared as a literal in the adapter's source; see --check")
    return 0


def _grammars(capabilities) -> str:
    if capabilities is None:
        return "?"
    return ", ".join(capabilities.describe())
