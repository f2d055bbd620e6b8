"""Checks on JSON schemas before a backend sees them, so a bad schema fails with the same clear
message on every backend."""

from __future__ import annotations

import warnings
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from ..errors import GrammarCompileError

__all__ = ["check_json_schema"]


def check_json_schema(schema: Any) -> None:
    """Raise :class:`GrammarCompileError` unless ``schema`` is valid under its meta-schema (the
    draft its ``$schema`` names, Draft 2020-12 by default). The message gives the JSON path."""
    if isinstance(schema, bool):
        return
    try:
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    except Exception as e:  # an unknown $schema URI
        raise GrammarCompileError(f"invalid JSON Schema: {e}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the regex format checker warns on odd patterns
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise GrammarCompileError(f"invalid JSON Schema at {where}: {error.message[:300]}")
