"""Soak: thousands of requests through one speculative worker; resident memory must stay flat.

Writes a JSONL batch file (the ``spec-grammar generate --batch-file`` format) of mixed requests:
JSONSchemaBench schemas, regexes, GBNF, tool calls, plain prompts, grammars that fail to compile
and schemas made distinct per request (so the compile cache, kept small here, keeps evicting).
The lines are parsed by the CLI's own batch parser and run through ONE ``SpecWorker`` on CPU
(SmolLM2, n-gram drafts), ``--chunk`` requests per ``run`` call (a server's batches). After
every chunk: ``gc.collect()``, then the process's resident set (``/proc/self/statm``).

Reported: RSS after warm-up (the first ``--warmup`` fraction of the requests) and at the end,
growth in MiB and MiB per 1,000 requests after warm-up, the least-squares slope, finish reasons,
the compile cache's size and compile count. Prompts are the raw line text (no chat template):
the soak is about memory, not output quality, and short prompts keep it fast.

    python benchmarks/soak.py --requests 2000 --max-new-tokens 4 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

REGEXES = [r"(yes|no|maybe)", r"[A-Z][a-z]{2,8}", r"\d{3}-\d{4}", r"[a-z]+@[a-z]+\.com"]
EBNF = [
    'root ::= "The answer is " [0-9]+ "."',
    'root ::= item (", " item)*\nitem ::= "red" | "green" | "blue"',
]


def rss_mib() -> float:
    """Resident set size of this process in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_batch(path: Path, n: int, seed: int = 0) -> None:
    """``n`` JSONL request lines of mixed kinds (deterministic for ``seed``)."""
    from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample

    rng = random.Random(seed)
    schemas = [r["schema"] for r in jsonschemabench_sample()][:20]
    tools = [c["tools"] for c in bfcl_cases()][:5]
    lines = []
    for i in range(n):
        kind = rng.choice(
            ["schema", "schema", "distinct", "regex", "ebnf", "tools", "plain", "bad"]
        )
        rec: dict = {"prompt": rng.choice(["Answer:", "Here is the JSON:", "Output:", "Reply:"])}
        if kind == "schema":
            rec["json_schema"] = rng.choice(schemas)
        elif kind == "distinct":  # a grammar no other request shares
            rec["json_schema"] = {
                "type": "object",
                "properties": {"id": {"enum": [f"r{i}"]}},
                "required": ["id"],
            }
        elif kind == "regex":
            rec["regex"] = rng.choice(REGEXES)
        elif kind == "ebnf":
            rec["ebnf"] = rng.choice(EBNF)
        elif kind == "tools":
            rec["tools"] = rng.choice(tools)
        elif kind == "bad":
            rec["regex"] = "([a-z]" if i % 2 else None
            if i % 2 == 0:
                rec["json_schema"] = {"type": "strnig"}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")


def soak(
    batch: Path,
    *,
    backend_name: str,
    chunk: int,
    max_new_tokens: int,
    cache_size: int,
    warmup: float,
) -> dict:
    import torch

    from spec_grammar.cli.generate import _GRAMMAR_FIELDS, _spec_from_fields
    from spec_grammar.models import load_model, load_tokenizer
    from spec_grammar.registry import get_backend
    from spec_grammar.worker import Request, SpecWorker
    from spec_grammar.worker.sampling import SamplingParams

    model, tok = load_model("smollm2", dtype=torch.float32), load_tokenizer("smollm2")
    backend = get_backend(
        backend_name, tok, vocab_size=model.config.vocab_size, compile_cache_size=cache_size
    )
    records = [json.loads(x) for x in batch.read_text().splitlines() if x.strip()]
    reasons: collections.Counter = collections.Counter()
    samples: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    with SpecWorker(model, tok, backend=backend, draft="ngram", num_draft_tokens=6) as worker:
        for start in range(0, len(records), chunk):
            reqs = []
            for rec in records[start : start + chunk]:
                try:
                    spec = (
                        _spec_from_fields(rec)
                        if any(rec.get(k) is not None for k in _GRAMMAR_FIELDS)
                        else None
                    )
                except ValueError:  # a line the CLI would mark as failed
                    reasons["bad line"] += 1
                    continue
                reqs.append(
                    Request(
                        tok.encode(rec["prompt"]),
                        spec,
                        SamplingParams(max_new_tokens=max_new_tokens),
                    )
                )
            for r in worker.run(reqs):
                reasons[r.finish_reason] += 1
            gc.collect()
            done = min(start + chunk, len(records))
            samples.append((done, rss_mib()))
            print(
                f"{done:6d} requests  rss {samples[-1][1]:8.1f} MiB  {time.perf_counter() - t0:7.1f} s",
                file=sys.stderr,
            )
    n_warm = max(1, int(len(samples) * warmup))
    after = samples[n_warm - 1 :]
    xs = [x for x, _ in after]
    ys = [y for _, y in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    growth = ys[-1] - ys[0]
    span = (xs[-1] - xs[0]) / 1000 or 1.0
    return {
        "requests": len(records),
        "backend": backend_name,
        "max_new_tokens": max_new_tokens,
        "chunk": chunk,
        "wall_s": round(time.perf_counter() - t0, 1),
        "finish_reasons": dict(reasons),
        "rss_mib_after_warmup": round(ys[0], 1),
        "rss_mib_end": round(ys[-1], 1),
        "rss_mib_max": round(max(y for _, y in samples), 1),
        "growth_mib_after_warmup": round(growth, 1),
        "growth_mib_per_1000_requests": round(growth / span, 2),
        "slope_mib_per_1000_requests": round(slope * 1000, 2),
        "compile_cache_entries": len(backend._cache),
        "compile_cache_size": cache_size,
        "compiles": backend.num_compiles,
        "samples": samples,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--chunk", type=int, default=25, help="requests per worker.run call")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--grammar-backend", default="xgrammar")
    p.add_argument("--compile-cache-size", type=int, default=32)
    p.add_argument(
        "--warmup", type=float, default=0.1, help="fraction of the requests counted as warm-up"
    )
    p.add_argument("--batch-file", type=Path, help="use this JSONL file instead of generating one")
    p.add_argument("--out", type=Path, help="directory for soak-<backend>-<n>.json")
    args = p.parse_args()
    batch = args.batch_file
    if batch is None:
        batch = Path(f"/tmp/spec-grammar-soak-{args.requests}.jsonl")
        make_batch(batch, args.requests)
    res = soak(
        batch,
        backend_name=args.grammar_backend,
        chunk=args.chunk,
        max_new_tokens=args.max_new_tokens,
        cache_size=args.compile_cache_size,
        warmup=args.warmup,
    )
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"soak-{args.grammar_backend}-{res['requests']}.json").write_text(
            json.dumps(res, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
