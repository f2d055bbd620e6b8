"""xgrammar compile latency on real inputs: eager vs dynamic (lazy) token-mask compilation.

Why: with JSON-Schema semantics (``strict_mode=False``) xgrammar lets every object without
``additionalProperties: false`` take extra keys other than its declared names and encodes that
exclusion as a trie with one rule per byte of every declared name. At compile time each rule
gets a full-vocabulary token-mask scan, which is where BFCL tool lists spend ~all their compile
time. The adapter now compiles lazily (``XGrammarBackend(dynamic_compilation=True)``); this
script measures what that saves and what it moves into decoding.

Inputs: the bundled BFCL tool cases (``ToolCalls``) and the first ``--schemas`` JSONSchemaBench
schemas (``JsonSchema``), SmolLM2 tokenizer, one fresh backend per mode, each spec compiled once
through the public ``XGrammarBackend.compile`` (xgrammar's own cache is off). Per spec and mode:

- ``compile``: ``backend.compile(spec)`` wall time (ms).
- ``+walk``: compile plus a mask fill at every position of one token path (ms): the BFCL
  ``example_output`` serialized with the mode's separators, or for schemas a seeded random
  walk of ``--walk`` tokens drawn from the eager mask. That is the cost a first request pays
  before its last mask, the fair comparison once work moves from compile to first fills.
- ``mismatch``: positions where the two modes' bitmasks differ (must be 0: same grammar).

Also ``--options``: raw xgrammar ``compile_json_schema`` time for each
(separators, any_whitespace, strict_mode) on the first BFCL cases, to show which option costs.

    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py [--whitespace spaced,compact,flexible]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from spec_grammar_xgrammar import XGrammarBackend

from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.errors import SpecGrammarError
from spec_grammar.models import load_tokenizer
from spec_grammar.specs import JsonSchema, ToolCalls

_DUMPS = {"spaced": {}, "compact": {"separators": (",", ":")}, "flexible": {}}


def _walk(backend, compiled, path, walk_len, seed):
    """Fill a mask at each position of the token list ``path`` (up to its first rejected
    token), or of a seeded random walk of up to ``walk_len`` tokens drawn from the filled
    masks when ``path`` is None.

    Returns (seconds spent in mask fills, rows: int32 tensor ``[positions, ceil(V/32)]``,
    the token path taken).
    """
    m = backend.matcher(compiled)
    rng = random.Random(seed)
    steps = len(path) if path is not None else walk_len
    bm = allocate_token_bitmask(steps + 1, backend.vocab_size)
    taken: list[int] = []
    fill_s = 0.0  # mask fills only: choosing the random token is not the library's cost
    for i in range(steps + 1):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bm, i)
        fill_s += time.perf_counter() - t0
        if i == steps:
            break
        if path is not None:
            tok = path[i]
        else:
            ids = [
                t for t in allowed_token_ids(bm[i], backend.vocab_size) if not m.is_stop_token(t)
            ]
            if not ids:
                break
            tok = rng.choice(ids)
        if not m.accept_token(tok):  # example outputs need not follow the schema's key order
            break
        taken.append(tok)
    return fill_s, bm[: len(taken) + 1].clone(), taken


def _specs(whitespace: str, n_schemas: int, tok):
    out = []
    for case in bfcl_cases():
        text = json.dumps(case["example_output"], **_DUMPS[whitespace])
        out.append(
            (
                "bfcl",
                ToolCalls(case["tools"], whitespace=whitespace),
                tok.encode(text, add_special_tokens=False),
            )
        )
    for row in jsonschemabench_sample()[:n_schemas]:
        out.append(("jsb", JsonSchema(row["schema"], whitespace=whitespace), None))
    return out


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_modes(tok, whitespace: str, n_schemas: int, walk_len: int) -> list[str]:
    backends = {d: XGrammarBackend(tok, dynamic_compilation=d) for d in (False, True)}
    stats: dict[tuple[str, bool], dict[str, list[float]]] = {}
    mismatches: dict[str, int] = {"bfcl": 0, "jsb": 0}
    skipped = 0
    for i, (group, spec, path) in enumerate(_specs(whitespace, n_schemas, tok)):
        results = {}
        try:
            for dyn in (False, True):  # eager first: the dynamic run follows the eager path
                be = backends[dyn]
                t0 = time.perf_counter()
                compiled = be.compile(spec)
                tc = time.perf_counter() - t0
                tw, rows, path = _walk(be, compiled, path, walk_len, i)
                results[dyn] = (tc, tw, rows)
        except SpecGrammarError as e:  # a schema xgrammar refuses: refused in both modes
            skipped += 1
            print(f"  skip {group} #{i}: {type(e).__name__}: {str(e)[:80]}")
            continue
        a, b = results[False][2], results[True][2]
        mismatches[group] += int(a.shape != b.shape) or int((a != b).any(dim=1).sum())
        for dyn, (tc, tw, _) in results.items():
            s = stats.setdefault((group, dyn), {"compile": [], "walk": []})
            s["compile"].append(tc * 1e3)
            s["walk"].append((tc + tw) * 1e3)
    lines = []
    for group in ("bfcl", "jsb"):
        e, d = stats.get((group, False)), stats.get((group, True))
        if not e:
            continue
        n = len(e["compile"])
        cells = []
        for key in ("compile", "walk"):
            em, ep = statistics.median(e[key]), _pct(e[key], 0.9)
            dm, dp = statistics.median(d[key]), _pct(d[key], 0.9)
            cells += [f"{em:.1f} / {ep:.1f}", f"{dm:.1f} / {dp:.1f}", f"{em / dm:.1f}x"]
        lines.append(
            f"| {whitespace} | {group} ({n}) | " + " | ".join(cells) + f" | {mismatches[group]} |"
        )
    if skipped:
        lines.append(f"({skipped} spec(s) skipped: compile error in both modes)")
    return lines


def run_options(tok, n_cases: int) -> None:
    from spec_grammar_bench.peers import XGrammarRawCompile

    raw = XGrammarRawCompile(tok)
    schemas = [ToolCalls(c["tools"]).to_json_schema().schema_json() for c in bfcl_cases()[:n_cases]]
    print(
        f"\nraw xgrammar compile_json_schema, first {n_cases} BFCL cases, max_threads=1, cache off "
        "(ms median, EBNF chars median)"
    )
    print(
        "| any_whitespace | separators | strict_mode | eager ms | dynamic ms | EBNF chars |\n|---|---|---|---|---|---|"
    )
    for aw, sep in ((True, None), (False, (", ", ": ")), (False, (",", ":"))):
        for strict in (True, False):
            kw = {"any_whitespace": aw, "separators": sep, "strict_mode": strict}
            times = {False: [], True: []}
            sizes = [raw.ebnf_chars(s, **kw) for s in schemas]
            for s in schemas:
                for dyn in (False, True):
                    times[dyn].append(raw.compile_ms(s, dynamic=dyn, **kw))
            print(
                f"| {aw} | {sep!r} | {strict} | {statistics.median(times[False]):.1f} | "
                f"{statistics.median(times[True]):.1f} | {statistics.median(sizes):.0f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--whitespace", default="spaced", help="comma list of spaced,compact,flexible")
    ap.add_argument("--schemas", type=int, default=30, help="JSONSchemaBench schemas (first N)")
    ap.add_argument("--walk", type=int, default=32, help="random-walk length for schemas (tokens)")
    ap.add_argument(
        "--options", type=int, default=0, help="also time raw xgrammar options on N BFCL cases"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer("smollm2")
    print(
        "xgrammar compile, SmolLM2 (V=49,152), ms median / p90; eager = dynamic_compilation=False (before)"
    )
    print(
        "| whitespace | inputs | compile eager | compile dynamic | ratio "
        "| compile+walk eager | compile+walk dynamic | ratio | mask mismatches |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for ws in args.whitespace.split(","):
        for line in run_modes(tok, ws.strip(), args.schemas, args.walk):
            print(line, flush=True)
    if args.options:
        run_options(tok, args.options)


if __name__ == "__main__":
    main()
