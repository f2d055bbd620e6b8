"""Loaders for the bundled real inputs (see ``spec_grammar/data/README.md`` for sources and
licenses)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.resources import files
from typing import Any

__all__ = ["jsonschemabench_sample", "bfcl_cases", "json_schema_test_suite"]


def _jsonl(relpath: str) -> Iterator[dict[str, Any]]:
    with files("spec_grammar").joinpath("data", relpath).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def jsonschemabench_sample(subset: str | None = None) -> list[dict[str, Any]]:
    """84 real schemas, ``{"subset", "id", "schema"}``, 12 per JSONSchemaBench subset."""
    return [
        r for r in _jsonl("jsonschemabench/sample.jsonl") if subset is None or r["subset"] == subset
    ]


def bfcl_cases() -> list[dict[str, Any]]:
    """40 BFCL tool-calling cases with OpenAI-style ``tools`` and a ``required_schema``."""
    return list(_jsonl("bfcl/cases.jsonl"))


def json_schema_test_suite(include_optional: bool = False) -> list[dict[str, Any]]:
    """JSON-Schema-Test-Suite draft 2020-12 groups (remote ``$ref`` groups left out)."""
    return [
        g
        for g in _jsonl("json_schema_test_suite/draft2020-12.jsonl")
        if (include_optional or not g["optional"]) and not g["needs_remote"]
    ]
