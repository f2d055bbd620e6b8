"""Which JSON-Schema-Test-Suite documents a backend accepts, compared with ``jsonschema``.

Every instance is serialized with ``json.dumps`` (the ``spaced`` whitespace policy), tokenized
with the SmolLM2 tokenizer and fed with EOS to a fresh matcher of ``JsonSchema(schema,
whitespace="spaced")``. Outcomes: ``accept``, ``reject``, ``unsupported`` (the backend refused
the schema with a typed compile error). :func:`compare_backends` lays several backends side
by side; only rows where they differ from each other or from ``jsonschema`` are reported.

What must hold (the property ``smollm2_json_suite_sound``): a backend never accepts an
instance ``jsonschema`` rejects, except where :data:`LIBRARY_SEMANTICS` lists the library's
documented leniency for that keyword. Rejecting a valid instance is reported, not failed:
grammar engines legitimately cover only part of JSON Schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import jsonschema

from ..datasets import json_schema_test_suite
from ..errors import GrammarCompileError
from ..protocol import GrammarBackend
from ..specs import JsonSchema
from .core import ConformanceFailure, Session, conformance_property

__all__ = ["Case", "suite_cases", "acceptance", "compare_backends", "format_table", "LIBRARY_SEMANTICS"]

Outcome = Literal["accept", "reject", "unsupported"]

QUICK_FILES = (
    "type.json", "enum.json", "const.json", "required.json", "properties.json",
    "additionalProperties.json", "items.json", "prefixItems.json", "minItems.json", "maxItems.json",
    "minLength.json", "maxLength.json", "minimum.json", "maximum.json", "pattern.json", "anyOf.json",
    "allOf.json", "oneOf.json", "uniqueItems.json", "multipleOf.json", "exclusiveMinimum.json",
    "exclusiveMaximum.json", "minProperties.json", "maxProperties.json", "boolean_schema.json", "defs.json",
)
"""Files of the quick run (core keywords); the long run takes every group."""

LIBRARY_SEMANTICS: dict[str, dict[str, str]] = {
    "xgrammar": {
        "uniqueItems.json": "xgrammar 0.2.9 does not enforce uniqueItems (ignored, documented in its JSON-schema converter)",
        "multipleOf.json": "xgrammar 0.2.9 ignores multipleOf for numbers",
        "oneOf.json": "xgrammar treats oneOf as anyOf (exclusivity is not a context-free property)",
        "allOf.json": "xgrammar merges only simple allOf branches",
        "minProperties.json": "xgrammar ignores minProperties/maxProperties on objects with additional properties",
        "maxProperties.json": "xgrammar ignores minProperties/maxProperties on objects with additional properties",
    },
    "llguidance": {
        "oneOf.json": "llguidance treats oneOf as anyOf when branches cannot be shown disjoint",
        "uniqueItems.json": "llguidance ignores uniqueItems in lenient mode",
    },
    "outlines": {
        "uniqueItems.json": "outlines-core's regex translation ignores uniqueItems",
        "multipleOf.json": "outlines-core's regex translation ignores multipleOf",
        "oneOf.json": "outlines-core translates oneOf as an alternation (anyOf)",
        "allOf.json": "outlines-core supports only a single allOf branch exactly",
        "minProperties.json": "outlines-core ignores minProperties/maxProperties",
        "maxProperties.json": "outlines-core ignores minProperties/maxProperties",
    },
}
"""backend name -> {test-suite file -> why accepting some invalid instances there is the
library's documented semantics, not an adapter bug}. Only these are excused."""


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
    """Instances of the draft 2020-12 suite (remote refs left out); quick: :data:`QUICK_FILES`."""
    out = []
    for g in json_schema_test_suite():
        if not slow and g["file"] not in QUICK_FILES:
            continue
        for i, t in enumerate(g["tests"]):
            out.append(Case(g["file"], g["group_index"], g["group_description"], i, t["description"],
                            g["schema"], t["data"], bool(t["valid"])))
    return out


def jsonschema_valid(case: Case) -> bool:
    """``jsonschema``'s verdict (draft 2020-12, ``format`` not asserted); the suite's own label
    where ``jsonschema`` cannot evaluate the schema (Python's ``re`` lacks ``\\p{...}``)."""
    try:
        return jsonschema.Draft202012Validator(case.schema).is_valid(case.data)
    except Exception:
        return case.valid


def acceptance(backend: GrammarBackend, cases: Iterable[Case]) -> dict[str, Outcome]:
    """``case.key -> outcome`` on ``backend`` (built on the SmolLM2 tokenizer)."""
    tok = backend.tokenizer_info.hf_tokenizer
    stop = backend.tokenizer_info.stop_token_ids[0]
    out: dict[str, Outcome] = {}
    compiled: dict[str, Any] = {}
    for case in cases:
        key = json.dumps(case.schema, sort_keys=False)
        if key not in compiled:
            try:
                compiled[key] = backend.compile(JsonSchema(case.schema, whitespace="spaced"))
            except GrammarCompileError:
                compiled[key] = None
        if compiled[key] is None:
            out[case.key] = "unsupported"
            continue
        ids = tok.encode(case.text, add_special_tokens=False) + [stop]
        m = backend.matcher(compiled[key])
        n = m.accept_tokens(ids)
        out[case.key] = "accept" if n == len(ids) and m.is_terminated() else "reject"
    return out


def compare_backends(outcomes: dict[str, dict[str, Outcome]], cases: Iterable[Case]) -> list[dict[str, Any]]:
    """Rows where backends differ from ``jsonschema`` or from each other:
    ``{"key", "group", "instance", "jsonschema", <backend>: outcome, ...}``."""
    rows = []
    for case in cases:
        truth = "accept" if jsonschema_valid(case) else "reject"
        got = {name: res.get(case.key, "-") for name, res in outcomes.items()}
        if all(v == truth for v in got.values()):
            continue
        rows.append({"key": case.key, "group": case.group_description, "instance": case.text[:60],
                     "jsonschema": truth, **got})
    return rows


def format_table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    """Markdown table of :func:`compare_backends` rows."""
    cols = ["key", "group", "instance", "jsonschema", *backends]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).replace("|", "\\|")[:70] for c in cols) + " |")
    return "\n".join(lines)


@conformance_property(
    "smollm2_json_suite_sound",
    "a backend never accepts a JSON-Schema-Test-Suite instance that jsonschema rejects "
    "(documented library semantics excepted), and never refuses a schema with an untyped error",
    "smollm2",
)
def json_suite_sound(session: Session) -> None:
    backend = session.backend("smollm2")
    cases = suite_cases(session.slow)
    results = acceptance(backend, cases)
    excused = LIBRARY_SEMANTICS.get(backend.name, {})
    bad = []
    for case in cases:
        if results[case.key] == "accept" and not jsonschema_valid(case) and case.file not in excused:
            bad.append(case)
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
