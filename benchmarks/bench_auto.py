"""``auto`` against each fixed backend on the same requests, and the post-check's cost.

The e2e benchmark's prompts (:func:`spec_grammar_bench.e2e.load_prompts`: JSONSchemaBench and
BFCL cases alternating, schema in the prompt), SmolLM2-135M-Instruct float32 on the CPU, greedy,
the n-gram drafter, default output limits. One worker per backend, the same requests in one
batch each; per row: tokens/s (output tokens over the run's wall time), grammar ms per output
token (the steps' matcher advance + tree fill, hidden + exposed: the mask work; and the exposed
part alone), outputs valid / completed
(the post-check, :mod:`spec_grammar.output_check`), and the post-check's own time against the
run's wall time (each output checked again here, timed with ``perf_counter``). Every row's
grammars are compiled before its clock starts (the CLI precompiles them too; auto's backends are
built then). Rows run one after the other in one process (a backend may be named twice, to see
the host's drift); on a shared host run it under ``nice`` and say so.

    python benchmarks/bench_auto.py --jsb 4 --bfcl 4 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from spec_grammar_bench.e2e import E2EBenchConfig, load_prompts

from spec_grammar import get_backend
from spec_grammar.errors import SpecGrammarError
from spec_grammar.json_schema.limits import DEFAULT_OUTPUT_LIMITS
from spec_grammar.models import load_model, load_tokenizer
from spec_grammar.output_check import check_output
from spec_grammar.specs import with_limits
from spec_grammar.worker import SpecWorker
from spec_grammar.worker.request import Request
from spec_grammar.worker.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jsb", type=int, default=4)
    p.add_argument("--bfcl", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--backends", default="xgrammar,llguidance,outlines,auto")
    p.add_argument("--out", default="benchmarks/results/routing/auto.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer("smollm2")
    model = load_model("smollm2")
    vocab = int(model.config.vocab_size)
    prompts = load_prompts(E2EBenchConfig(jsb_cases=args.jsb, bfcl_cases=args.bfcl), tok)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = {}
    for run, name in enumerate(args.backends.split(",")):
        backend = get_backend(name, tok, vocab_size=vocab, compile_timeout_s=30)
        worker = SpecWorker(model, tok, backend=backend, draft="ngram")
        reqs = [
            Request(
                prompt=pr.prompt_ids,
                grammar=with_limits(pr.spec, DEFAULT_OUTPUT_LIMITS),
                sampling=params,
                rid=pr.name,
            )
            for pr in prompts
        ]
        for q in reqs:  # compiles (and auto's backends) before the clock, as the CLI does
            try:
                backend.compile(q.grammar)
            except SpecGrammarError:  # the run reports it as that request's error
                pass
        t0 = time.perf_counter()
        with worker:
            results = worker.run(reqs)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        for r, q in zip(results, reqs):
            if r.valid is not None:
                check_output(q.grammar, r.text)
        check_s = time.perf_counter() - t1
        tokens = sum(r.num_tokens for r in results)
        # the steps' grammar work (a request's own grammar_ms counts every step it was live
        # in, so requests sharing a step share its fill: not additive across requests)
        grammar_ms = sum(st.grammar_ms for st in worker.step_stats)
        exposed_ms = sum(st.grammar_exposed_ms for st in worker.step_stats)
        rows[f"{run}:{name}"] = {
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "grammar_ms_per_token": grammar_ms / max(tokens, 1),
            "grammar_exposed_ms_per_token": exposed_ms / max(tokens, 1),
            "steps": len(worker.step_stats),
            "completed": sum(r.valid is not None for r in results),
            "valid": sum(r.valid is True for r in results),
            "errors": sum(r.finish_reason == "error" for r in results),
            "cut": sum(r.finish_reason == "length" for r in results),
            "check_ms": check_s * 1e3,
            "check_share_of_wall": check_s / wall,
            "picks": sorted({r.backend for r in results if r.backend}),
            "per_request": {
                r.rid: {
                    "backend": r.backend,
                    "tokens": r.num_tokens,
                    "grammar_ms": r.grammar_ms_hidden + r.grammar_ms_exposed,
                    "valid": r.valid,
                    "finish": r.finish_reason,
                }
                for r in results
            },
        }
        shown = {k: v for k, v in rows[f"{run}:{name}"].items() if k != "per_request"}
        print(name, json.dumps(shown), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
