"""The speculative worker on real inputs: speculation and overlap on/off, side by side.

One batch of real requests (JSONSchemaBench schemas spread over the subsets, BFCL tool-calling
cases as ``ToolCalls``; the schema or tool list written into the chat prompt with
:func:`spec_grammar.worker.schema_prompt`), run through :class:`SpecWorker` once per row:

- ``no-spec`` / ``no-spec sync``: plain constrained decoding (root-only trees), grammar work
  overlapped / in order;
- ``ngram`` / ``ngram sync``: the default n-gram tree drafter, overlapped / in order;
- ``ngram lazy``: the same, verified lazily (no tree fills: ``SpecWorker(lazy_grammar=True)``);
- ``self:L topk=K``: the target's first L layers as drafter (EAGLE-2-style tree).

Rows run one after the other on the same loaded model (greedy), ``--rounds`` times,
interleaved (load on a shared machine hits every row alike); the median round is reported.
Each row keeps one worker for all its rounds, as a server keeps its worker, after
``--warmup`` untimed runs (default 1): on a GPU the first run captures a CUDA graph for every
batch / tree / context-length bucket it meets (tens of ms each), and every first run of a
grammar builds xgrammar's mask caches for the positions its tree fills reach.
Per row: validity rate (outputs that completed their grammar and validate with ``jsonschema``
Draft 2020-12, over all requests; length-cut outputs are counted apart), mean accept length
(output tokens per request-step), tokens/s (all output tokens over the batch's wall time,
prefill included), draft / verify-forward ms per step, grammar ms per step and the exposed
part (waited for after the verify forward), the mean step time (draft to commit: tokens/s
also pays the requests' prefill), and the share of steps whose greedy walks met a token
the grammar refuses (*refused*: a masked row on the device; lazily, a one-row fill too). Ratios are
against ``no-spec`` and the in-order
row of the same drafter. Every constrained row must produce the no-spec tokens (greedy): a
mismatch is printed.

    python benchmarks/bench_worker.py --backend xgrammar --requests 16 --max-new-tokens 64

``--grammar-threads 1,2 --batches 16,32`` instead compares the grammar work of a step split
over threads (``SpecWorker(grammar_threads=N)``): the n-gram row per batch size and thread
count, in order (grammar work alone, so its time is not shared with the forward) and
overlapped, with the grammar ms per step and its ratio to the first thread count. Every row
must produce the tokens of the first thread count's row (a mismatch is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jsonschema
import torch
from spec_grammar_bench.inputs import bfcl_tool_cases, jsonschemabench_cases
from spec_grammar_bench.inputs import real_requests as case_requests

from spec_grammar.worker import SpecWorker
from spec_grammar.worker.api import summarize
from spec_grammar.worker.sampling import SamplingParams


def real_requests(tokenizer, n: int, max_new_tokens: int, max_schema_chars: int):
    """``n`` requests: 3/4 schemas of at most ``max_schema_chars`` characters, round-robin over
    the JSONSchemaBench subsets (sorted by name), 1/4 BFCL; and their oracle schemas."""
    n_bfcl = n // 4
    cases = jsonschemabench_cases(subset_order="sorted", max_schema_chars=max_schema_chars)
    cases = cases[: n - n_bfcl] + bfcl_tool_cases()[:n_bfcl]
    reqs = case_requests(tokenizer, cases, SamplingParams(max_new_tokens=max_new_tokens))
    return reqs, [c.schema for c in cases]


def valid_count(results, oracles) -> tuple[int, int]:
    """(outputs that completed the grammar and validate, outputs cut by max_new_tokens)."""
    ok = cut = 0
    for r, schema in zip(results, oracles):
        if r.finish_reason == "length":
            cut += 1
        elif r.finish_detail == "grammar":
            try:
                jsonschema.Draft202012Validator(schema).validate(json.loads(r.text))
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return ok, cut


def compare_grammar_threads(args, model, tok, backend) -> list[dict]:
    """Grammar ms per step with the step's grammar work split over 1..N threads, side by side."""
    threads = [int(x) for x in args.grammar_threads.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    print(
        f"grammar threads {threads} ({args.backend}, {args.model}, {args.device}, torch threads "
        f"{torch.get_num_threads()}, {os.cpu_count()} cores), ngram drafter ({args.num_draft_tokens} nodes), "
        f"max_new_tokens {args.max_new_tokens}, "
        f"median of {args.rounds} round(s)"
    )
    print(
        f"{'batch':>5} {'mode':8} {'threads':>7} {'gram ms':>8} {'x 1st':>6} {'exposed':>8} "
        f"{'fwd ms':>7} {'tok/s':>7} {'steps':>6}"
    )
    out = []
    for n in batches:
        reqs, _ = real_requests(tok, n, args.max_new_tokens, args.max_schema_chars)
        for r in reqs:
            try:
                backend.compile(r.grammar)
            except Exception:  # an error row, the same for every thread count
                pass
        for overlap in (False, True):
            runs: dict[int, list] = {t: [] for t in threads}
            tokens: dict[int, list] = {}
            for _ in range(args.rounds):
                for t in threads:  # interleaved: load on a shared machine hits every row alike
                    with SpecWorker(
                        model,
                        tok,
                        backend=backend,
                        device=args.device,
                        draft="ngram",
                        num_draft_tokens=args.num_draft_tokens,
                        overlap=overlap,
                        grammar_threads=t,
                    ) as w:
                        start = time.perf_counter()
                        res = w.run(reqs)
                        runs[t].append(summarize(res, w.step_stats, time.perf_counter() - start))
                    tokens[t] = [r.token_ids for r in res]
            base = None
            for t in threads:
                s = sorted(runs[t], key=lambda x: x.grammar_ms_per_step)[len(runs[t]) // 2]
                base = base or s.grammar_ms_per_step
                mode = "overlap" if overlap else "in order"
                print(
                    f"{len(reqs):5d} {mode:8} {t:7d} {s.grammar_ms_per_step:8.2f} {base / s.grammar_ms_per_step:6.2f} "
                    f"{s.grammar_exposed_ms_per_step:8.2f} {s.verify_forward_ms_per_step:7.1f} "
                    f"{s.tokens_per_s:7.1f} {s.steps:6d}"
                )
                if tokens[t] != tokens[threads[0]]:
                    diff = sum(a != b for a, b in zip(tokens[t], tokens[threads[0]]))
                    print(f"  !! {diff} outputs differ from grammar_threads={threads[0]}")
                out.append(
                    {
                        "batch": len(reqs),
                        "overlap": overlap,
                        "grammar_threads": t,
                        "same_tokens": tokens[t] == tokens[threads[0]],
                        **s.model_dump(),
                    }
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--max-schema-chars", type=int, default=1200, help="skip larger schemas (prompt length)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rows", help="comma-separated subset of the rows (no-spec included)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per row before the rounds")
    ap.add_argument("--self-layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument(
        "--grammar-threads",
        metavar="N,M,..",
        help="compare grammar thread counts instead (see above)",
    )
    ap.add_argument("--batches", default="16,32", help="batch sizes of --grammar-threads")
    ap.add_argument(
        "--num-draft-tokens", type=int, default=8, help="n-gram tree size of --grammar-threads"
    )
    args = ap.parse_args()

    from spec_grammar.models import load_model, load_tokenizer
    from spec_grammar.registry import get_backend

    model = load_model(args.model, device=args.device)
    tok = load_tokenizer(args.model)
    backend = get_backend(args.backend, tok, vocab_size=model.config.vocab_size)
    if args.grammar_threads:
        out = compare_grammar_threads(args, model, tok, backend)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return
    reqs, oracles = real_requests(tok, args.requests, args.max_new_tokens, args.max_schema_chars)
    t0 = time.perf_counter()
    for r in reqs:
        try:
            backend.compile(r.grammar)
        except Exception:  # counted as errors by the rows
            pass
    compile_s = time.perf_counter() - t0
    rows = {
        "no-spec": dict(no_spec=True),
        "no-spec sync": dict(no_spec=True, overlap=False),
        "ngram": dict(draft="ngram", num_draft_tokens=8),
        "ngram sync": dict(draft="ngram", num_draft_tokens=8, overlap=False),
        "ngram lazy": dict(draft="ngram", num_draft_tokens=8, lazy_grammar=True),
        f"self:{args.self_layers} topk=3": dict(
            draft=f"self:{args.self_layers}", topk=3, num_steps=4, num_draft_tokens=8
        ),
    }
    if args.rows:
        unknown = set(args.rows.split(",")) - set(rows)
        if unknown or "no-spec" not in args.rows.split(","):
            ap.error(
                f"--rows: unknown {sorted(unknown)} or no no-spec (the baseline); rows: {', '.join(rows)}"
            )
        rows = {k: v for k, v in rows.items() if k in args.rows.split(",")}
    runs: dict[str, list] = {k: [] for k in rows}
    tokens: dict[str, list] = {}
    workers = {
        name: SpecWorker(model, tok, backend=backend, device=args.device, **opts)
        for name, opts in rows.items()
    }
    try:
        for w in workers.values():
            for _ in range(args.warmup):
                w.run(reqs)
        for _ in range(args.rounds):
            for name, w in workers.items():
                t = time.perf_counter()
                res = w.run(reqs)
                wall = time.perf_counter() - t
                refused = sum(s.forbidden_rows > 0 for s in w.step_stats) / max(
                    1, len(w.step_stats)
                )
                step_ms = sum(s.step_ms for s in w.step_stats) / max(1, len(w.step_stats))
                runs[name].append(
                    (
                        summarize(res, w.step_stats, wall),
                        valid_count(res, oracles),
                        refused,
                        step_ms,
                    )
                )
                tokens[name] = [r.token_ids for r in res]
    finally:
        for w in workers.values():
            w.close()
    print(
        f"{len(reqs)} requests ({args.backend}, {args.model}, {args.device}, torch threads {torch.get_num_threads()}), "
        f"max_new_tokens {args.max_new_tokens}, compile {compile_s:.1f} s, {args.warmup} warm-up run(s), "
        f"{args.rounds} round(s)"
    )
    head = (
        f"{'row':18} {'valid':>7} {'cut':>4} {'accept':>6} {'tok/s':>7} {'x no-spec':>9} {'draft ms':>8} "
        f"{'fwd ms':>7} {'gram ms':>7} {'exposed':>7} {'refused':>7} {'step ms':>7}"
    )
    print(head)
    out = []
    base = None
    for name in rows:
        ranked = sorted(runs[name], key=lambda x: x[0].tokens_per_s)
        s, (ok, cut), refused, step_ms = ranked[len(ranked) // 2]
        base = base or s.tokens_per_s
        print(
            f"{name:18} {ok:3d}/{s.requests:<3d} {cut:4d} {s.accept_length:6.2f} {s.tokens_per_s:7.1f} "
            f"{s.tokens_per_s / base:9.2f} {s.draft_ms_per_step:8.2f} {s.verify_forward_ms_per_step:7.1f} "
            f"{s.grammar_ms_per_step:7.2f} {s.grammar_exposed_ms_per_step:7.2f} {100 * refused:6.0f}% {step_ms:7.2f}"
        )
        same = tokens[name] == tokens["no-spec"]
        if not same:
            diff = sum(a != b for a, b in zip(tokens[name], tokens["no-spec"]))
            print(f"  !! {diff} outputs differ from no-spec (near-tie argmax flips in float32?)")
        out.append(
            {
                "row": name,
                "valid": ok,
                "cut": cut,
                "same_as_no_spec": same,
                "refused_share": refused,
                "step_ms": step_ms,
                **s.model_dump(),
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
