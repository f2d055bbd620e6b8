"""What the compile-time fault checks cost next to the compile they guard (issue 33).

- llguidance: :func:`spec_grammar_llguidance.probe.first_rows_fault` (three rows, six consumes
  each) plus :func:`~spec_grammar_llguidance.probe.wide_object` (a walk of the schema) against
  ``backend.compile(spec)`` as a whole (the checks included);
- xgrammar: :func:`spec_grammar_xgrammar.strings.bounded_strings_fixed` (print, patch and parse
  of the grammar) against ``backend.compile(spec)``, on the schemas with ``minLength`` /
  ``maxLength``.

Inputs: the bundled JSONSchemaBench sample and BFCL tool cases, SmolLM2 tokenizer, each spec
compiled once on a fresh backend (no cache hit). Prints per backend the total and median
compile and check times and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/bench_compile_checks.py
"""

from __future__ import annotations

import json
import statistics
import time

from spec_grammar import get_backend
from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.errors import SpecGrammarError
from spec_grammar.specs import JsonSchema, ToolCalls
from spec_grammar.testing.fixtures import fixture_tokenizer


def _specs() -> list:
    return [JsonSchema(r["schema"]) for r in jsonschemabench_sample()] + [
        ToolCalls(c["tools"]) for c in bfcl_cases()
    ]


def _report(name: str, compiles: list[float], checks: list[float]) -> None:
    total_c, total_k = sum(compiles), sum(checks)
    print(
        f"{name:<11} specs {len(compiles):>3}  compile total {total_c * 1e3:8.1f} ms "
        f"median {statistics.median(compiles) * 1e3:6.2f} ms | check total {total_k * 1e3:7.1f} ms "
        f"median {statistics.median(checks) * 1e3:5.2f} ms | check/compile {total_k / total_c:6.1%} "
        f"(median of ratios {statistics.median(k / c for k, c in zip(checks, compiles)):6.1%})"
    )


def llguidance_probe() -> None:
    from spec_grammar_llguidance.probe import first_rows_fault, wide_object

    tok, width = fixture_tokenizer("smollm2")
    b = get_backend("llguidance", tok, vocab_size=width)
    compiles, checks = [], []
    for spec in _specs():
        t0 = time.perf_counter()
        try:
            compiled = b.compile(spec)
        except SpecGrammarError:
            continue
        t1 = time.perf_counter()
        schema = spec.to_json_schema() if isinstance(spec, ToolCalls) else spec
        wide_object(schema.json_schema, 2000)
        first_rows_fault(
            compiled.native.prototype, b._token_lengths, frozenset(b.tokenizer_info.stop_token_ids)
        )
        compiles.append(t1 - t0)
        checks.append(time.perf_counter() - t1)
    _report("llguidance", compiles, checks)


def xgrammar_patch() -> None:
    import xgrammar as xgr
    from spec_grammar_xgrammar.strings import bounded_strings_fixed

    tok, width = fixture_tokenizer("smollm2")
    b = get_backend("xgrammar", tok, vocab_size=width)
    compiles, checks = [], []
    for spec in _specs():
        text = spec.cache_key()
        if "Length" not in text:
            continue
        t0 = time.perf_counter()
        try:
            b.compile(spec)
        except SpecGrammarError:
            continue
        t1 = time.perf_counter()
        schema = spec.to_json_schema() if isinstance(spec, ToolCalls) else spec
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema.json_schema), strict_mode=False)
        t2 = time.perf_counter()
        bounded_strings_fixed(grammar)
        compiles.append(t1 - t0)
        checks.append(time.perf_counter() - t2)
    _report("xgrammar", compiles, checks)


if __name__ == "__main__":
    llguidance_probe()
    xgrammar_patch()
