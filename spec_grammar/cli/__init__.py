"""``spec-grammar`` command line: one module per subcommand, each with ``register(subparsers)``
that adds its parser and sets ``func`` (called with the parsed args, returns an exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import SpecGrammarError

SUBCOMMANDS = ["backends", "conformance", "generate", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spec-grammar",
        description="Grammar-constrained tree speculative decoding: backends, conformance, generation, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (SpecGrammarError, FileNotFoundError, ValueError) as e:
        print(f"spec-grammar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
