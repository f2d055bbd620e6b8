"""The quick start as a user meets it: ``spec-grammar --help`` time, time to the first output
byte (the first streamed chunk) and tokens/s of the README's quick-start command, per CPU thread
count (``OMP_NUM_THREADS``) on a quiet host and under load (busy-loop processes, one per core).

Usage: ``python benchmarks/bench_startup.py [--checkout DIR] [--threads 1,2] [--repeats 2]``.
``--checkout`` runs another checkout's code (PYTHONPATH) with this interpreter, to compare
branches side by side in one run. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

QUICK_START = [
    "generate",
    "--json-schema",
    "examples/schemas/person.json",
    "Invent a software engineer and describe them.",
]


def _busy() -> None:
    while True:
        pass


def _env(checkout: Path, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(checkout / d) for d in ("", "adapters", "benchmarks"))
    env.pop("OMP_NUM_THREADS", None)
    env.pop("SPEC_GRAMMAR_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _run(checkout: Path, args: list[str], threads: int | None) -> tuple[float, float, str]:
    """(seconds to the first stdout byte, seconds to exit, stderr)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-m", "spec_grammar", *args],
        cwd=checkout,
        env=_env(checkout, threads),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = p.stdout.read(1)
    t_first = time.perf_counter() - t0
    p.stdout.read()
    err = p.stderr.read().decode()
    p.wait()
    if not first:
        t_first = float("nan")
    return t_first, time.perf_counter() - t0, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--threads", default="default,1,2", help="comma list; 'default' = unset")
    ap.add_argument("--loads", default="0,2", help="busy-loop processes (comma list)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    helps = [_run(checkout, ["--help"], 1)[1] for _ in range(3)]
    print(f"checkout {checkout}: --help {min(helps):.2f} s (best of 3)")
    print("| busy loops | OMP threads | first output s | total s | tok/s (stderr) |")
    print("|---|---|---|---|---|")
    for load in [int(x) for x in args.loads.split(",")]:
        procs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(load)]
        for p in procs:
            p.start()
        try:
            for t in args.threads.split(","):
                threads = None if t == "default" else int(t)
                for _ in range(args.repeats):
                    first, total, err = _run(checkout, QUICK_START, threads)
                    m = re.search(r"\(([\d.]+) tok/s\)", err)
                    print(
                        f"| {load} | {t} | {first:.2f} | {total:.2f} | {m.group(1) if m else err.strip()[-200:]} |",
                        flush=True,
                    )
        finally:
            for p in procs:
                p.terminate()
                p.join()


if __name__ == "__main__":
    main()
