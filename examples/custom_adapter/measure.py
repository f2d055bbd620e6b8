"""Measure the example backend next to a built-in one on the same regexes and tokenizer.

Prints, per pattern and backend: compile time, the mean cost of the first mask at each new
state along a real tokenization (the example computes rows lazily, so this is its cold cost),
a warm mask fill, accept + rollback(1), and the ratio to the reference backend.

Usage: ``python examples/custom_adapter/measure.py [--reference xgrammar] [--model smollm2]``
(the example must be importable: installed, or run from the repository root).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_grammar import Regex, allocate_token_bitmask, get_backend  # noqa: E402
from spec_grammar.models import load_tokenizer  # noqa: E402

CASES = [
    (
        r"[A-Z]{3}-[0-9]{4} (active|inactive|pending) [a-z]+@[a-z]+\.com \d{1,3}(\.\d{1,2})?",
        "ABC-1234 active joe@example.com 12.5",
    ),
    (r'\{"name": "[^"\\]{1,30}", "age": [0-9]{1,3}\}', '{"name": "Ann Lee", "age": 42}'),
    (r"(日本|é|ü)+ [a-z]{1,10}", "日本éü abc"),
    (r".{0,40}", "Any text at all, up to forty characters"),
]


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(backend, pattern: str, ids: list[int], reps: int) -> dict[str, float]:
    t0 = time.perf_counter()
    compiled = backend.compile(Regex(pattern))
    compile_ms = (time.perf_counter() - t0) * 1e3
    bm = allocate_token_bitmask(1, backend.vocab_size)
    m = backend.matcher(compiled)
    cold = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bm, 0)
        cold.append(time.perf_counter() - t0)
        if not m.accept_token(t):
            raise SystemExit(f"{backend.name} refused token {t} of {pattern!r}")
    m.rollback(len(ids) // 2)
    warm = _median_us(lambda: m.fill_next_token_bitmask(bm, 0), reps)
    t = ids[len(ids) // 2]
    step = _median_us(lambda: (m.accept_token(t), m.rollback(1)), reps)
    return {
        "compile ms": compile_ms,
        "cold fill ms": statistics.mean(cold) * 1e3,
        "warm fill us": warm,
        "accept+rollback us": step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", default="xgrammar", help="backend to compare with")
    ap.add_argument("--model", default="smollm2", help="tokenizer (see spec_grammar.models)")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    t0 = time.perf_counter()
    ours = get_backend("spec_grammar_interegular:InteregularBackend", tok)
    ours.token_table()
    print(
        f"{args.model}: {len(tok)} tokens; example vocabulary table built in {time.perf_counter() - t0:.2f} s"
    )
    ref = get_backend(args.reference, tok)
    for pattern, text in CASES:
        ids = tok.encode(text, add_special_tokens=False)
        a, b = measure(ours, pattern, ids, args.reps), measure(ref, pattern, ids, args.reps)
        print(
            f"\n{pattern}  ({len(ids)} tokens, {ours.compile(Regex(pattern)).native.dfa.num_states} DFA states)"
        )
        print(f"  {'':20s} {'interegular':>12s} {args.reference:>12s} {'ratio':>7s}")
        for key in a:
            print(f"  {key:20s} {a[key]:12.2f} {b[key]:12.2f} {a[key] / b[key]:7.2f}")


if __name__ == "__main__":
    main()
