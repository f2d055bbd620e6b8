"""Output limits on the real model: a prompt that made SmolLM2 write digits until the token
budget (no document) completes with a valid one under ``max_string_length``; the output is
checked by ``jsonschema`` against the user's schema and the cap."""

from __future__ import annotations

import json

import jsonschema
import pytest

from spec_grammar.json_schema.limits import OutputLimits
from spec_grammar.worker import api

SCHEMA = {"type": "object", "properties": {"digits": {"type": "string"}}, "required": ["digits"]}


@pytest.mark.model
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_cut_prompt_completes_valid_under_the_limits(backend):
    prompt = api.schema_prompt(SCHEMA, "Write the first 300 digits of pi.")
    common = dict(grammar=SCHEMA, max_new_tokens=64, device="cpu", grammar_backend=backend)
    [cut] = api.generate(prompt, output_limits=None, **common)
    assert cut.finish_reason == "length", cut.text  # the runaway: digits until the budget
    [done] = api.generate(prompt, output_limits=OutputLimits(max_string_length=32), **common)
    assert done.finish_detail == "grammar", done.text
    doc = json.loads(done.text)
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert len(doc["digits"]) <= 32
    # the same greedy path up to the cap: the limit changes only where it binds
    assert done.text.startswith(cut.text[: len('{"digits": "') + 32])
