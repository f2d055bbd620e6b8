"""Real grammar cases for the benchmarks: bundled JSONSchemaBench schemas and BFCL tool calls,
each with a valid instance to grow draft trees along.

BFCL cases carry an ``example_output`` (used when the dataset marks it valid). JSONSchemaBench
schemas have none, so one is sampled from the compiled grammar itself with a fixed seed
(:func:`sample_instance`) and kept only if ``jsonschema`` validates it (the oracle).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import jsonschema
import numpy as np

from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.protocol import GrammarBackend
from spec_grammar.specs import GrammarSpec, JsonSchema, ToolCalls

__all__ = ["Case", "load_cases", "sample_instance"]

_MAX_SAMPLE_TOKENS = 400
_TARGET_TOKENS = 60


@dataclass
class Case:
    """One grammar of the benchmark.

    Attributes:
        name: ``"<source>/<id>"``.
        source: ``"jsonschemabench"`` or ``"bfcl"``.
        spec: the grammar spec (``JsonSchema`` or ``ToolCalls``).
        schema: the JSON schema an instance must validate against (the oracle).
        instance: a valid instance as text, or None until sampled.
    """

    name: str
    source: str
    spec: GrammarSpec
    schema: Any
    instance: str | None = None


def load_cases(max_per_source: int | None = None) -> list[Case]:
    """JSONSchemaBench then BFCL cases, at most ``max_per_source`` of each. JSONSchemaBench
    schemas come round-robin over its subsets, so any prefix of the list (a small sample, or
    what a time budget allows) covers every kind of schema."""
    by_subset: dict[str, list[dict]] = {}
    for r in jsonschemabench_sample():
        by_subset.setdefault(r["subset"], []).append(r)
    limit = sum(map(len, by_subset.values())) if max_per_source is None else max_per_source
    jsb: list[dict] = []
    for i in range(max(map(len, by_subset.values()), default=0)):
        jsb.extend(rows[i] for rows in by_subset.values() if i < len(rows))
    jsb = jsb[:limit]
    cases = [
        Case(
            f"jsonschemabench/{r['subset']}/{r['id']}",
            "jsonschemabench",
            JsonSchema(r["schema"]),
            r["schema"],
        )
        for r in jsb
    ]
    bfcl = bfcl_cases()
    if max_per_source is not None:
        bfcl = bfcl[:max_per_source]
    for c in bfcl:
        # an example output the dataset marks invalid is not used; one is sampled instead
        instance = json.dumps(c["example_output"]) if c.get("example_output_valid") else None
        cases.append(
            Case(f"bfcl/{c['id']}", "bfcl", ToolCalls(c["tools"]), c["required_schema"], instance)
        )
    return cases


def sample_instance(backend: GrammarBackend, case: Case, seed: int = 0) -> str | None:
    """A valid instance of ``case`` sampled from its grammar, or None (no termination within
    400 tokens, or ``jsonschema`` rejects the text).

    Sampling: uniform over allowed non-special tokens; the first ~60 tokens avoid tokens that
    close an object or array (so instances are not ``{}``), after that the shortest tokens
    holding ``" } ] ,`` are preferred with rising probability, so strings and containers end.
    The stop token is taken as soon as it is allowed. Deterministic for a given ``seed``.
    """
    from .trees import allowed_ids

    info = backend.tokenizer_info
    table = info.token_bytes
    closing = np.array([b"}" in b or b"]" in b for b in table])
    ending = np.array([any(c in b for c in b'"}],') for b in table])
    length = np.array([len(b) for b in table])
    special = np.zeros(len(table), dtype=bool)
    special[[t for t in info.special_token_ids if t < len(table)]] = True
    rng = random.Random(seed)
    m = backend.matcher(backend.compile(case.spec))
    ids: list[int] = []
    while len(ids) < _MAX_SAMPLE_TOKENS:
        allowed = allowed_ids(m)[: len(table)]
        if any(allowed[t] for t in info.stop_token_ids):
            break
        cand = np.flatnonzero(allowed & ~special)
        if not len(cand):
            return None
        if rng.random() < min(0.95, len(ids) / _TARGET_TOKENS):
            ends = cand[ending[cand]]
            if len(ends):
                cand = ends[length[ends] == length[ends].min()]
        else:
            opens = cand[~closing[cand]]
            if len(opens):
                cand = opens
        t = int(cand[rng.randrange(len(cand))])
        if not m.accept_token(t):
            return None
        ids.append(t)
    else:
        return None
    text = info.decode(ids)
    try:
        jsonschema.validate(json.loads(text), case.schema)
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return None
    return text
