"""What the ``auto`` backend's routing table rests on (``docs/routing.md``).

Two tables, on the bundled corpora (``spec_grammar/data``: the JSONSchemaBench sample, the BFCL
tool lists as ``ToolCalls``, the JSON-Schema-Test-Suite groups), SmolLM2's tokenizer:

1. *enforced*: per corpus, the share of schemas whose every keyword a backend enforces, by its
   declarations (:func:`spec_grammar.routing.user_unenforced`; default output limits set), for
   each registered backend and for ``auto`` (its choice: :func:`spec_grammar.routing.rank`);
2. *cost*: per backend and corpus, the median compile ms (a fresh backend per corpus, cache
   off, ``compile_timeout_s`` = ``--timeout``) and the median mask us per token: along a
   walk of up to ``--tokens`` tokens, each step ``fill_next_token_bitmask`` then
   ``accept_token`` of a token drawn (seeded) among the allowed ones, timing the fill.

Run under ``nice`` on a shared host: the numbers are medians of one run and say so.

    python benchmarks/bench_routing.py --out benchmarks/results/routing
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from spec_grammar import get_backend, list_backends
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.datasets import bfcl_cases, json_schema_test_suite, jsonschemabench_sample
from spec_grammar.errors import SpecGrammarError
from spec_grammar.json_schema.limits import DEFAULT_OUTPUT_LIMITS
from spec_grammar.models import load_tokenizer
from spec_grammar.routing import rank, unenforced_limits, user_unenforced
from spec_grammar.specs import JsonSchema, ToolCalls


def corpora() -> dict[str, list]:
    lim = DEFAULT_OUTPUT_LIMITS
    return {
        "jsonschemabench": [JsonSchema(r["schema"], limits=lim) for r in jsonschemabench_sample()],
        "bfcl": [ToolCalls(r["tools"], limits=lim) for r in bfcl_cases()],
        "suite": [JsonSchema(g["schema"], limits=lim) for g in json_schema_test_suite()],
    }


def enforced_table(specs_by_corpus, classes) -> dict:
    out = {}
    for corpus, specs in specs_by_corpus.items():
        row = {}
        for name, cls in classes.items():
            if not cls.capabilities.json_schema:
                continue
            row[name] = sum(not user_unenforced(cls, s) for s in specs) / len(specs)
        picks = [rank(s, classes)[0] for s in specs]
        row["auto"] = sum(not p.unenforced for p in picks) / len(specs)
        row["auto_limits_all"] = sum(not p.unenforced and not p.limits for p in picks) / len(specs)
        row["n"] = len(specs)
        row["auto_picks"] = {n: sum(p.name == n for p in picks) for n in row if n in classes}
        out[corpus] = row
    return out


def walk_us(backend, compiled, tokens: int, rng: random.Random) -> list[float]:
    m = backend.matcher(compiled)
    mask = allocate_token_bitmask(1, backend.vocab_size)
    out = []
    for _ in range(tokens):
        if m.is_terminated():
            break
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        out.append((time.perf_counter() - t0) * 1e6)
        bits = mask[0].numpy().view("uint32")
        allowed = [
            w * 32 + b for w in range(bits.size) if bits[w] for b in range(32) if bits[w] >> b & 1
        ]
        if not allowed:
            break
        m.accept_token(rng.choice(allowed))
    return out


def cost_table(specs_by_corpus, names, tok, args) -> dict:
    out = {}
    for name in names:
        for corpus, specs in specs_by_corpus.items():
            b = get_backend(name, tok, compile_cache_size=0, compile_timeout_s=args.timeout)
            rng = random.Random(0)
            compile_ms, mask_us, failed = [], [], 0
            t_start = time.perf_counter()
            for spec in specs[: args.limit]:
                if time.perf_counter() - t_start > args.budget:
                    break
                t0 = time.perf_counter()
                try:
                    c = b.compile(spec)
                except SpecGrammarError:
                    failed += 1
                    continue
                compile_ms.append((time.perf_counter() - t0) * 1e3)
                mask_us += walk_us(b, c, args.tokens, rng)
            out[f"{name}/{corpus}"] = {
                "compiled": len(compile_ms),
                "failed": failed,
                "compile_ms_median": statistics.median(compile_ms) if compile_ms else None,
                "mask_us_median": statistics.median(mask_us) if mask_us else None,
                "mask_us_mean": statistics.fmean(mask_us) if mask_us else None,
            }
            print(name, corpus, out[f"{name}/{corpus}"], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/routing")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--limit", type=int, default=40, help="schemas per corpus for the cost table")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--budget", type=float, default=60.0, help="seconds per backend and corpus")
    p.add_argument("--no-cost", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    infos = [i for i in list_backends() if i.error is None]
    from spec_grammar.registry import load_backend_class

    classes = {i.name: load_backend_class(i.name) for i in infos}
    specs = corpora()
    result = {"enforced": enforced_table(specs, classes)}
    print(json.dumps(result["enforced"], indent=1), flush=True)
    if not args.no_cost:
        tok = load_tokenizer("smollm2")
        json_names = [n for n, c in classes.items() if c.capabilities.json_schema]
        result["cost"] = cost_table(specs, json_names, tok, args)
    result["limits_unenforced_example"] = {
        n: unenforced_limits(c, specs["jsonschemabench"][0]) for n, c in classes.items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
