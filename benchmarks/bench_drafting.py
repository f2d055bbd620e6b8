"""Grammar-aware drafting on real inputs: unconstrained vs constrained drafting vs forced
tokens vs both, side by side, per drafter and grammar backend.

Requests: JSONSchemaBench schemas (one per subset, smallest first) and BFCL tool-calling
cases as ``ToolCalls``, the schema / tool list written into the chat prompt
(:func:`spec_grammar.worker.schema_prompt`); SmolLM2 on CPU, greedy, one batch per row.
Rows per drafter (``ngram``, ``self:L``): ``plain`` (unconstrained drafting),
``constrain`` (``constrain_draft``: grammar-masked trees, rows reused for verification),
``forced`` (``forced_tokens``), ``both``; the ``grammar`` drafter (forced tokens alone) has
``forced`` and ``both``. Every row of a backend must produce exactly the tokens of the first
row (float64 model by default, so batch-shape near-tie argmax flips cannot happen): a
mismatch is reported in the table. Per row and request group (``bfcl``, ``schemas``):
mean accept length (output tokens per request-step) and tokens/s (the group's output tokens
over the batch's wall time, prefill included, for the whole batch); the ratio columns are
against the drafter's ``plain`` row.

Each invocation adds its rows to ``--out`` (JSON, keyed by backend/drafter/mode/group) and
rewrites the Markdown table next to it, so backends can be run one at a time::

    python benchmarks/bench_drafting.py --backend xgrammar --drafters ngram,self:4,grammar
    python benchmarks/bench_drafting.py --backend llguidance --drafters ngram --bfcl 6 --schemas 0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from spec_grammar_bench.inputs import bfcl_tool_cases, jsonschemabench_cases
from spec_grammar_bench.inputs import real_requests as case_requests
from spec_grammar_bench.report import write_report

from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.sampling import SamplingParams

MODES = {
    "plain": dict(constrain_draft=False, forced_tokens=False),
    "constrain": dict(constrain_draft=True, forced_tokens=False),
    "forced": dict(constrain_draft=False, forced_tokens=True),
    "both": dict(constrain_draft=True, forced_tokens=True),
}


def real_requests(
    tokenizer, n_schemas: int, n_bfcl: int, max_new_tokens: int, backend
) -> list[tuple[str, Request]]:
    """``(group, request)``: the smallest compilable schema of each JSONSchemaBench subset in
    turn, then the first BFCL cases."""
    schemas = []
    for case in jsonschemabench_cases(subset_order="sorted", smallest_first=True):
        if len(schemas) >= n_schemas:
            break
        try:
            backend.compile(case.spec)
        except Exception:  # not every backend supports every schema: take the next one
            continue
        schemas.append(case)
    cases = schemas + bfcl_tool_cases()[:n_bfcl]
    reqs = case_requests(tokenizer, cases, SamplingParams(max_new_tokens=max_new_tokens))
    return [
        ("schemas" if c.source == "jsonschemabench" else "bfcl", r) for c, r in zip(cases, reqs)
    ]


def render_markdown(rows: list[dict]) -> str:
    lines = [
        "# Grammar-aware drafting (SmolLM2-135M, CPU, greedy)",
        "",
        "Produced by `benchmarks/bench_drafting.py`. accept = output tokens per request-step; "
        "tok/s = the group's output tokens over the batch's wall time (whole batch, prefill "
        "included; CPU shared with other jobs, so tok/s is noisy); x = ratio to the drafter's "
        "`plain` (unconstrained) row; same = tokens identical to the backend's first row.",
        "",
        "| backend | drafter | mode | group | requests | tokens | accept | x accept | tok/s | x tok/s | same |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {(r["backend"], r["drafter"], r["group"]): r for r in rows if r["mode"] == "plain"}
    for r in rows:
        b = base.get((r["backend"], r["drafter"], r["group"]))
        xa = f"{r['accept_length'] / b['accept_length']:.2f}" if b else "-"
        xt = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}" if b else "-"
        lines.append(
            f"| {r['backend']} | {r['drafter']} | {r['mode']} | {r['group']} | {r['requests']} | "
            f"{r['output_tokens']} | {r['accept_length']:.2f} | {xa} | {r['tokens_per_s']:.2f} | {xt} | "
            f"{'yes' if r['same'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument(
        "--drafters", default="ngram,self:4,grammar", help="comma-separated: ngram, self:L, grammar"
    )
    ap.add_argument("--modes", default="plain,constrain,forced,both")
    ap.add_argument("--schemas", type=int, default=6)
    ap.add_argument("--bfcl", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--out", default="benchmarks/results/drafting.json")
    args = ap.parse_args()

    from spec_grammar.models import load_model, load_tokenizer
    from spec_grammar.registry import get_backend

    model = load_model("smollm2", dtype=getattr(torch, args.dtype))
    tok = load_tokenizer("smollm2")
    backend = get_backend(args.backend, tok, vocab_size=model.config.vocab_size)
    items = real_requests(tok, args.schemas, args.bfcl, args.max_new_tokens, backend)
    groups = [g for g, _ in items]
    reqs = [r for _, r in items]
    modes = args.modes.split(",")
    out_path = Path(args.out).with_suffix(".json")  # the Markdown table goes next to it
    rows = json.loads(out_path.read_text()) if out_path.exists() else []
    reference = None
    print(
        f"{args.backend}: {groups.count('schemas')} schemas + {groups.count('bfcl')} BFCL, "
        f"{args.max_new_tokens} new tokens, {args.dtype}, torch threads {torch.get_num_threads()}"
    )
    for drafter in args.drafters.split(","):
        for mode in modes:
            if drafter == "grammar" and not MODES[mode]["forced_tokens"]:
                continue  # forced tokens are the grammar drafter
            opts = dict(draft=drafter, num_draft_tokens=args.num_draft_tokens, **MODES[mode])
            if drafter.startswith("self:"):
                opts.update(topk=2, num_steps=4)
            with SpecWorker(model, tok, backend=backend, device="cpu", **opts) as w:
                t0 = time.perf_counter()
                results = w.run(reqs)
                wall = time.perf_counter() - t0
            tokens = [r.token_ids for r in results]
            reference = reference or tokens
            for group in ("bfcl", "schemas"):
                sel = [r for g, r in zip(groups, results) if g == group]
                if not sel:
                    continue
                n = sum(r.num_tokens for r in sel)
                steps = sum(r.steps for r in sel)
                row = dict(
                    backend=args.backend,
                    drafter=drafter,
                    mode=mode,
                    group=group,
                    requests=len(sel),
                    output_tokens=n,
                    steps=steps,
                    accept_length=n / max(steps, 1),
                    tokens_per_s=n / wall,
                    wall_s=wall,
                    errors=sum(r.finish_reason == "error" for r in sel),
                    same=all(a == b for g, a, b in zip(groups, tokens, reference) if g == group),
                    dtype=args.dtype,
                    max_new_tokens=args.max_new_tokens,
                )
                rows = [
                    r
                    for r in rows
                    if (r["backend"], r["drafter"], r["mode"], r["group"])
                    != (args.backend, drafter, mode, group)
                ]
                rows.append(row)
                print(
                    f"{drafter:8} {mode:9} {group:7} accept {row['accept_length']:.2f} "
                    f"tok/s {row['tokens_per_s']:.2f} same {row['same']} errors {row['errors']}",
                    flush=True,
                )
            write_report(rows, out_path.parent, out_path.stem, render_markdown(rows))


if __name__ == "__main__":
    main()
