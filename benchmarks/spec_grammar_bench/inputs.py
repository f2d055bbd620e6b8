"""Real inputs of the benchmarks, built in one place from the bundled datasets
(:mod:`spec_grammar.datasets`): JSONSchemaBench schemas and BFCL tool calls as :class:`Case`
objects, their chat prompts and worker requests (the schema or tool list written into the user
message by :func:`spec_grammar.worker.schema_prompt`), and valid instances to grow draft trees
along.

- cases: :func:`jsonschemabench_cases` (round-robin over the subsets, so any prefix covers every
  kind of schema), :func:`bfcl_tool_cases`, and :func:`load_cases` (both sources, the cases of
  ``spec-grammar bench masks|e2e|gpu``);
- prompts and requests: :func:`chat_prompt` and :func:`real_requests` (BFCL cases ask their own
  user question, schemas a fixed task: :data:`TASK_DOCUMENT` in ``bench e2e``,
  :data:`TASK_SHORT` in the scripts);
- instances: BFCL cases carry an ``example_output`` (used when the dataset marks it valid).
  JSONSchemaBench schemas have none, so one is sampled from the compiled grammar itself with a
  fixed seed (:func:`sample_instance`) and kept only if ``jsonschema`` validates it (the oracle).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import numpy as np

from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.protocol import GrammarBackend
from spec_grammar.specs import GrammarSpec, JsonSchema, ToolCalls

__all__ = [
    "Case",
    "TASK_DOCUMENT",
    "TASK_SHORT",
    "jsonschemabench_cases",
    "bfcl_tool_cases",
    "load_cases",
    "chat_prompt",
    "real_requests",
    "sample_instance",
]

TASK_DOCUMENT = "Produce a realistic example document."
"""What ``bench e2e`` asks for a JSONSchemaBench schema."""
TASK_SHORT = "Give a short, realistic example."
"""What the worker and drafting scripts ask for a JSONSchemaBench schema."""

_MAX_SAMPLE_TOKENS = 400
_TARGET_TOKENS = 60


@dataclass
class Case:
    """One real grammar of the benchmarks.

    Attributes:
        name: ``"<source>/<id>"`` (JSONSchemaBench: ``"jsonschemabench/<subset>/<id>"``).
        source: ``"jsonschemabench"`` or ``"bfcl"``.
        spec: the grammar spec (``JsonSchema`` or ``ToolCalls``).
        schema: the JSON schema an instance must validate against (the oracle).
        instance: a valid instance as text, or None until sampled.
        id: the dataset's id of the case (the request id of :func:`real_requests`).
        question: the BFCL case's user question; None for a schema (the prompt then asks a task).
    """

    name: str
    source: str
    spec: GrammarSpec
    schema: Any
    instance: str | None = None
    id: str = ""
    question: str | None = None


def jsonschemabench_cases(
    *,
    subset_order: Literal["dataset", "sorted"] = "dataset",
    smallest_first: bool = False,
    max_schema_chars: int | None = None,
) -> list[Case]:
    """Every bundled JSONSchemaBench schema, round-robin over the subsets (their first schemas,
    then their second ones, ...), so any prefix of the list covers every kind of schema.

    ``subset_order``: the subsets in the order the dataset first lists them, or sorted by name;
    ``smallest_first``: within a subset, shortest schema text (``json.dumps``) first instead of
    the dataset's order; ``max_schema_chars``: leave out longer schemas (prompt length)."""
    rows = jsonschemabench_sample()
    if smallest_first:
        rows = sorted(rows, key=lambda r: len(json.dumps(r["schema"])))
    by_subset: dict[str, list[dict]] = {}
    for r in rows:
        if max_schema_chars is None or len(json.dumps(r["schema"])) <= max_schema_chars:
            by_subset.setdefault(r["subset"], []).append(r)
    subsets = sorted(by_subset) if subset_order == "sorted" else list(by_subset)
    interleaved: list[dict] = []
    for i in range(max(map(len, by_subset.values()), default=0)):
        interleaved.extend(by_subset[s][i] for s in subsets if i < len(by_subset[s]))
    return [
        Case(
            f"jsonschemabench/{r['subset']}/{r['id']}",
            "jsonschemabench",
            JsonSchema(r["schema"]),
            r["schema"],
            id=r["id"],
        )
        for r in interleaved
    ]


def _bfcl_question(case: dict[str, Any]) -> str:
    """The user text of a BFCL case's first turn."""
    msgs = case["messages"]
    turn = msgs[0] if msgs and isinstance(msgs[0], list) else msgs
    return " ".join(m["content"] for m in turn if m.get("role") == "user")


def bfcl_tool_cases() -> list[Case]:
    """Every bundled BFCL case as a ``ToolCalls`` spec, in the dataset's order, with its user
    question; the oracle is the case's ``required_schema``. An example output the dataset marks
    invalid is not used (one is sampled instead)."""
    out = []
    for c in bfcl_cases():
        spec = ToolCalls(c["tools"])
        instance = json.dumps(c["example_output"]) if c.get("example_output_valid") else None
        schema = c.get("required_schema") or spec.to_json_schema().json_schema
        out.append(
            Case(
                f"bfcl/{c['id']}",
                "bfcl",
                spec,
                schema,
                instance,
                id=c["id"],
                question=_bfcl_question(c),
            )
        )
    return out


def load_cases(max_per_source: int | None = None) -> list[Case]:
    """JSONSchemaBench then BFCL cases, at most ``max_per_source`` of each. JSONSchemaBench
    schemas come round-robin over its subsets (:func:`jsonschemabench_cases`), so any prefix of
    the list (a small sample, or what a time budget allows) covers every kind of schema."""
    jsb = jsonschemabench_cases()
    bfcl = bfcl_tool_cases()
    if max_per_source is not None:
        jsb, bfcl = jsb[:max_per_source], bfcl[:max_per_source]
    return jsb + bfcl


def chat_prompt(tokenizer: Any, case: Case, task: str = TASK_SHORT) -> list[int]:
    """The chat prompt token ids of ``case``: its schema or tool list written into the user
    message (:func:`~spec_grammar.worker.schema_prompt`) with its own question (BFCL) or
    ``task`` (schemas), through the tokenizer's chat template
    (:func:`~spec_grammar.worker.build_prompt`)."""
    from spec_grammar.worker import build_prompt, schema_prompt

    text = case.question if case.question is not None else task
    return build_prompt(tokenizer, schema_prompt(case.spec, text))


def real_requests(
    tokenizer: Any, cases: Iterable[Case], sampling: Any, task: str = TASK_SHORT
) -> list[Any]:
    """One worker :class:`~spec_grammar.worker.Request` per case: the :func:`chat_prompt`, the
    case's spec as grammar, ``sampling`` (a ``SamplingParams``), the dataset id as ``rid``."""
    from spec_grammar.worker import Request

    return [Request(chat_prompt(tokenizer, c, task), c.spec, sampling, rid=c.id) for c in cases]


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
