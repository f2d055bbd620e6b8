"""``spec-grammar`` command line: one module per subcommand, each with ``register(subparsers)``
that adds its parser and sets ``func`` (called with the parsed args, returns an exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import SpecGrammarError

SUBCOMMANDS = ["backends", "conformance", "generate", "bench"]

_EXTRA_OF = {
    **dict.fromkeys(
        ("rich", "hypothesis", "transformers", "tokenizers", "gguf", "accelerate", "safetensors"),
        "cli",
    ),
    "matplotlib": "bench",
}
"""Top-level module -> the install extra that brings it (the base install has none of them)."""


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
    except (SpecGrammarError, OSError, ValueError) as e:  # OSError: a file or folder argument
        print(f"spec-grammar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = _EXTRA_OF.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"spec-grammar {args.command}: error: {e}; install it with: pip install 'spec-grammar[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
