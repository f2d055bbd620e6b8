"""Which JSON-Schema-Test-Suite documents a backend accepts, compared with ``jsonschema``.

Every instance is serialized with ``json.dumps`` (the ``spaced`` whitespace policy), tokenized
with the SmolLM2 tokenizer and fed with EOS to a fresh matcher of ``JsonSchema(schema,
whitespace="spaced")``. Outcomes: ``accept``, ``reject``, ``unsupported`` (the backend refused
the schema with a typed compile error). :func:`compare_backends` lays several backends side
by side; only rows where they differ from each other or from ``jsonschema`` are reported.

What must hold (the property ``smollm2_json_suite_sound``): a backend never accepts an
instance ``jsonschema`` rejects, except in the groups
:data:`~spec_grammar.testing.known_differences.KNOWN_UNSOUND` lists for that library.
Rejecting a valid instance is reported, not failed:
grammar engines legitimately cover only part of JSON Schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from ..datasets import json_schema_test_suite
from ..errors import GrammarCompileError
from ..protocol import GrammarBackend
from ..specs import JsonSchema
from .core import ConformanceFailure, PropertySkipped, Session, conformance_property
from .known_differences import known_unsound

__all__ = [
    "Case",
    "closed_schema",
    "suite_cases",
    "acceptance",
    "compare_backends",
    "format_table",
    "jsonschema_valid",
    "unsound_cases",
]

Outcome = Literal["accept", "reject", "unsupported"]


def closed_schema(schema: Any) -> bool:
    """True when no part of ``schema`` admits an arbitrary JSON value (every subschema has a
    ``type``/``const``/``enum``/``$ref``/combinator, objects forbid additional properties,
    arrays constrain their items). Such schemas compile fast on every engine; open ones (``{}``,
    ``true``, type-less keywords) make regex-based engines build an index of all of JSON."""
    if isinstance(schema, bool):
        return schema is False
    if not isinstance(schema, dict):
        return True
    if not any(k in schema for k in ("type", "const", "enum", "$ref", "anyOf", "oneOf", "allOf")):
        return False
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "object" in kinds and schema.get("additionalProperties", True) is not False:
        return False
    if "array" in kinds and "items" not in schema and "prefixItems" not in schema:
        return False
    subs: list[Any] = []
    for key in ("properties", "$defs", "patternProperties"):
        subs += list(schema.get(key, {}).values())
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        subs += schema.get(key, [])
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(schema.get(key), dict):
            subs.append(schema[key])
    return all(closed_schema(s) for s in subs)


@dataclass(frozen=True)
class Case:
    """One instance of one schema group."""

    file: str
    group: int
    group_description: str
    test: int
    description: str
    schema: Any
    data: Any
    valid: bool

    @property
    def key(self) -> str:
        return f"{self.file}#{self.group}/{self.test}"

    @property
    def text(self) -> str:
        return json.dumps(self.data)


def suite_cases(slow: bool = False) -> list[Case]:
    """Instances of the draft 2020-12 suite (remote refs left out); the quick run keeps the
    groups whose schema is :func:`closed_schema`."""
    out = []
    for g in json_schema_test_suite():
        if not slow and not closed_schema(g["schema"]):
            continue
        for i, t in enumerate(g["tests"]):
            out.append(
                Case(
                    g["file"],
                    g["group_index"],
                    g["group_description"],
                    i,
                    t["description"],
                    g["schema"],
                    t["data"],
                    bool(t["valid"]),
                )
            )
    return out


def jsonschema_valid(case: Case) -> bool:
    """``jsonschema``'s verdict (draft 2020-12, ``format`` not asserted); the suite's own label
    where ``jsonschema`` cannot evaluate the schema (Python's ``re`` lacks ``\\p{...}``)."""
    try:
        return jsonschema.Draft202012Validator(case.schema).is_valid(case.data)
    except Exception:  # jsonschema raises re.error, RefResolutionError, ... on what it cannot run
        return case.valid


def acceptance(backend: GrammarBackend, cases: Iterable[Case]) -> dict[str, Outcome]:
    """``case.key -> outcome`` on ``backend`` (built on the SmolLM2 tokenizer)."""
    tok = backend.tokenizer_info.hf_tokenizer
    stop = backend.tokenizer_info.stop_token_ids[0]
    out: dict[str, Outcome] = {}
    # one compiled grammar held at a time: an outlines index can take gigabytes
    key, compiled = None, None
    for case in sorted(cases, key=lambda c: json.dumps(c.schema, sort_keys=False)):
        if json.dumps(case.schema, sort_keys=False) != key:
            key = json.dumps(case.schema, sort_keys=False)
            try:
                compiled = backend.compile(JsonSchema(case.schema, whitespace="spaced"))
            except GrammarCompileError:
                compiled = None
        if compiled is None:
            out[case.key] = "unsupported"
            continue
        ids = tok.encode(case.text, add_special_tokens=False) + [stop]
        m = backend.matcher(compiled)
        n = m.accept_tokens(ids)
        out[case.key] = "accept" if n == len(ids) and m.is_terminated() else "reject"
    return out


def compare_backends(
    outcomes: dict[str, dict[str, Outcome]], cases: Iterable[Case]
) -> list[dict[str, Any]]:
    """Rows where backends differ from ``jsonschema`` or from each other:
    ``{"key", "group", "instance", "jsonschema", <backend>: outcome, ...}``."""
    rows = []
    for case in cases:
        truth = "accept" if jsonschema_valid(case) else "reject"
        got = {name: res.get(case.key, "-") for name, res in outcomes.items()}
        if all(v == truth for v in got.values()):
            continue
        rows.append(
            {
                "key": case.key,
                "group": case.group_description,
                "instance": case.text[:60],
                "jsonschema": truth,
                **got,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    """Markdown table of :func:`compare_backends` rows."""
    cols = ["key", "group", "instance", "jsonschema", *backends]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(
            "| " + " | ".join(str(r.get(c, "")).replace("|", "\\|")[:70] for c in cols) + " |"
        )
    return "\n".join(lines)


@conformance_property(
    "smollm2_json_suite_sound",
    "a backend never accepts a JSON-Schema-Test-Suite instance that jsonschema rejects "
    "(documented library semantics excepted), and never refuses a schema with an untyped error",
    "smollm2",
)
def json_suite_sound(session: Session) -> None:
    backend = session.backend("smollm2")
    if not backend.capabilities.json_schema:  # nothing to be sound about: not a vacuous pass
        raise PropertySkipped(f"{backend.name} does not compile JSON Schema")
    cases = suite_cases(session.slow)
    bad = unsound_cases(backend.name, acceptance(backend, cases), cases)
    if bad:
        first = bad[0]
        raise ConformanceFailure(
            "no instance jsonschema rejects is accepted",
            f"{len(bad)} unsound acceptances, e.g. {first.key} ({first.group_description}: {first.description}) "
            f"schema {json.dumps(first.schema)[:200]} instance {first.text[:100]}; all: "
            + ", ".join(c.key for c in bad[:20]),
            "reject",
            "accept",
        )


def unsound_cases(
    backend_name: str, outcomes: dict[str, Outcome], cases: Iterable[Case]
) -> list[Case]:
    """Cases accepted although ``jsonschema`` rejects them, known library semantics excepted."""
    return [
        c
        for c in cases
        if outcomes.get(c.key) == "accept"
        and not jsonschema_valid(c)
        and not known_unsound(backend_name, c.file, c.group)
    ]
