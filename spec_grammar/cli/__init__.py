"""``spec-grammar`` command line: one module per subcommand, each with ``register(subparsers)``
that adds its parser and sets ``func`` (called with the parsed args, returns an exit code)."""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
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


class InterruptReported(KeyboardInterrupt):
    """A Ctrl-C whose message (and the stats so far) the subcommand already printed."""


def main(argv: list[str] | None = None) -> int:
    """Run ``spec-grammar ARGV``; returns the exit code (130 after Ctrl-C).

    Called as the program (``argv`` None), an interrupt ends the process at once: the streams
    are flushed and the atexit handlers run, but the interpreter's teardown (freeing torch,
    the model and the grammar libraries' native state: 2-3 s, more on a loaded host) is
    skipped with ``os._exit``. Every ``finally`` has run by then; files the CLI writes (the
    model cache) are written to a temporary name and renamed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (SpecGrammarError, OSError, ValueError) as e:  # OSError: a file or folder argument
        print(f"spec-grammar {args.command}: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):  # a pipeline reading stdout gets a record, not nothing
            print(json.dumps({"error": str(e), "error_type": type(e).__name__, "exit_code": 2}))
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
    except KeyboardInterrupt as e:
        if not isinstance(e, InterruptReported):
            print(f"spec-grammar {args.command}: interrupted", file=sys.stderr)
        if argv is not None:
            return 130
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
