"""Real-world-style JSON schemas and tool lists we did not tune on, through the whole pipeline.

Faults this file was written for (each test fails without its fix):

- ``ToolCalls`` with pydantic-style parameters (``$defs`` + ``"$ref": "#/$defs/X"``, or ``"#"``
  recursion): embedding the parameters under ``items/.../arguments`` broke every local ref, and
  all three backends refused the tool list ("Cannot find field '$defs'", "Pointer does not
  exist", "Invalid reference path"). ``ToolCalls.to_json_schema`` now moves such parameters
  to the root ``$defs`` and rebases their refs.
- outlines-core 0.2.14 wrote property names into its pattern without JSON-escaping them
  (``{"a"b": 1}`` came out complete and "valid"), concatenated ``allOf`` branches
  (``{"a": 1}{"b": "x"}``) and emitted ``{"e":  }`` for a subschema ``enum: []``; the adapter now
  escapes the names and refuses the other two with a typed error.
- xgrammar 0.2.9 refused draft-04..2019 forms (tuple ``items``, boolean ``exclusiveMinimum``)
  of valid older-draft schemas; the adapter rewrites them to their draft 2020-12 equivalents.

Oracles: ``jsonschema`` on every completed output whose compile reported no unenforced keyword,
each tool call's arguments against that tool's own parameters, greedy speculative tokens ==
the same worker's non-speculative tokens, fresh-matcher replay, typed errors from
:mod:`spec_grammar.errors` whose text is what the request reports.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
from real_model import JSON_BACKENDS, backend, model_and_tokenizer, replays

from spec_grammar import JsonSchema, ToolCalls
from spec_grammar.errors import GrammarCompileError, UnsupportedGrammarError
from spec_grammar.worker import Request, SpecWorker, build_prompt
from spec_grammar.worker.api import schema_prompt
from spec_grammar.worker.sampling import SamplingParams

MAX_NEW = 32

# pydantic's shape for a nested model: root $defs, refs "#/$defs/X", one self-reference "#"
PYDANTIC_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"$ref": "#/$defs/City"},
        "unit": {"$ref": "#/$defs/Unit"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {
        "City": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "Unit": {"enum": ["C", "F"]},
    },
}
# a second tool whose $defs use the same names for other types: the refs must stay per tool
OTHER_PARAMS = {
    "type": "object",
    "properties": {"n": {"$ref": "#/$defs/City"}, "next": {"$ref": "#"}},
    "required": ["n"],
    "additionalProperties": False,
    "$defs": {"City": {"type": "integer", "minimum": 0, "maximum": 9}},
}


def tool(name: str, params: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": params},
    }


WEATHER_TOOLS = [tool("get_weather", PYDANTIC_PARAMS)]
TWO_TOOLS = [tool("get_weather", PYDANTIC_PARAMS), tool("count", OTHER_PARAMS)]

# completes within MAX_NEW tokens on SmolLM2 greedy with every backend
GOOD = {
    "escaped-names": JsonSchema(
        {
            "type": "object",
            "properties": {
                'a"b': {"type": "integer"},
                "c\\d": {"type": "string", "maxLength": 3},
                "new\nline": {"type": "boolean"},
            },
            "required": ['a"b', "c\\d", "new\nline"],
            "additionalProperties": False,
        }
    ),
    "openapi-refs": JsonSchema(
        {
            "$defs": {
                "Pet": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "name": {"type": "string", "maxLength": 8},
                        "tag": {"type": ["string", "null"]},
                    },
                    "required": ["id", "name"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 1}
            },
            "required": ["pets"],
            "additionalProperties": False,
        }
    ),
    "unicode-enum": JsonSchema(
        {
            "type": "object",
            "properties": {"ключ": {"enum": ["значение", "😀", 'a"b', "\\n", 1, None]}},
            "required": ["ключ"],
            "additionalProperties": False,
        }
    ),
    "tools-defs": ToolCalls(WEATHER_TOOLS, parallel_tool_calls=False),
}
# fail to compile on every backend: a typed error that names the problem, for that request only
BAD = {
    "unknown-type": JsonSchema({"type": "object", "properties": {"a": {"type": "strin"}}}),
    "missing-ref": JsonSchema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
    "false": JsonSchema(False),
}


@functools.cache
def requests() -> tuple[Request, ...]:
    _, tok = model_and_tokenizer()
    params = SamplingParams(max_new_tokens=MAX_NEW)
    return tuple(
        Request(
            prompt=build_prompt(
                tok, schema_prompt(spec, "Keep it minimal: short strings, small numbers.")
            ),
            grammar=spec,
            sampling=params,
            rid=rid,
        )
        for rid, spec in {**GOOD, **BAD}.items()
    )


@functools.cache
def results(name: str, no_spec: bool) -> dict:
    model, tok = model_and_tokenizer()
    with SpecWorker(
        model, tok, backend=backend(name), draft="ngram", num_draft_tokens=6, no_spec=no_spec
    ) as w:
        return {r.rid: r for r in w.run(list(requests()))}


def schema_of(spec) -> dict:
    return (spec.to_json_schema() if isinstance(spec, ToolCalls) else spec).json_schema


def validate(schema, instance) -> None:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls(schema).validate(instance)


@pytest.mark.model
@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_mixed_real_world_batch_is_valid_typed_and_equal_to_plain_decoding(name):
    got, ref = results(name, False), results(name, True)
    completed = 0
    for req in requests():
        res = got[req.rid]
        if req.rid in BAD:
            with pytest.raises(GrammarCompileError) as err:
                backend(name).compile(req.grammar)
            assert res.finish_reason == "error" and res.num_tokens == 0, res
            assert res.error == str(err.value) and res.error.startswith(f"[{name}] "), res.error
            continue
        assert res.finish_detail in ("grammar", "length"), res
        assert res.token_ids == ref[req.rid].token_ids, (req.rid, res.text, ref[req.rid].text)
        assert replays(name, req.grammar, res.token_ids, res.finish_detail == "grammar"), res
        # a warning that only declares refusals (`<keyword>:refuses at ...`) weakens nothing:
        # such outputs are validated too
        weakened = [w for w in res.warnings if not w.split(" ", 1)[0].endswith(":refuses")]
        if res.finish_detail != "grammar" or weakened:
            continue
        completed += 1
        doc = json.loads(res.text)
        validate(schema_of(req.grammar), doc)
        if isinstance(req.grammar, ToolCalls):
            params = {t["function"]["name"]: t["function"]["parameters"] for t in req.grammar.tools}
            for call in doc:
                validate(params[call["name"]], call["arguments"])
    assert completed >= 3, f"{name}: too few completed outputs to check ({completed})"


def _accepts(name: str, spec, text: str) -> bool:
    b = backend(name)
    ids = b.tokenizer_info.hf_tokenizer.encode(text, add_special_tokens=False)
    return replays(name, spec, ids, True)


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_tool_parameters_with_local_refs_compile_and_enforce_each_tools_defs(name):
    """Refs of each tool resolve to that tool's $defs (same names, other types) and "#"
    recursion stays inside the tool; the grammar agrees with jsonschema on every instance."""
    spec = ToolCalls(TWO_TOOLS)
    schema = schema_of(spec)
    cases = [
        [{"name": "get_weather", "arguments": {"city": {"name": "Oslo"}, "unit": "C"}}],
        [{"name": "count", "arguments": {"n": 3, "next": {"n": 4}}}],
        [
            {"name": "get_weather", "arguments": {"city": {"name": "Oslo"}, "unit": "C"}},
            {"name": "count", "arguments": {"n": 1}},
        ],
        [{"name": "get_weather", "arguments": {"city": 3, "unit": "C"}}],  # City of the other tool
        [{"name": "count", "arguments": {"n": {"name": "Oslo"}}}],
        [{"name": "count", "arguments": {"n": 3, "next": {"city": {"name": "x"}, "unit": "C"}}}],
        [{"name": "get_weather", "arguments": {"city": {"name": "Oslo"}, "unit": "K"}}],
    ]
    for doc in cases:
        valid = jsonschema.Draft202012Validator(schema).is_valid(doc)
        assert _accepts(name, spec, json.dumps(doc)) == valid, (name, doc, valid)
    assert sum(jsonschema.Draft202012Validator(schema).is_valid(d) for d in cases) == 3


def test_tool_refs_are_rebased_only_where_they_are_schema_refs():
    """Literal values that look like refs, and tools with their own $id, stay as written."""
    params = {
        "type": "object",
        "properties": {"default": {"$ref": "#/$defs/X"}, "c": {"const": {"$ref": "#/x"}}},
        "$defs": {"X": {"type": "integer"}},
    }
    schema = ToolCalls([tool("f", params)]).to_json_schema().json_schema
    assert schema["items"]["properties"]["arguments"] == {"$ref": "#/$defs/tool0"}
    args = schema["$defs"]["tool0"]
    assert args["properties"]["default"] == {"$ref": "#/$defs/tool0/$defs/X"}
    assert args["properties"]["c"] == {"const": {"$ref": "#/x"}}
    # no local ref (or an own $id): the parameters stay inline, exactly as before
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with_id = {**params, "$id": "https://example.com/f"}
    for p in (plain, with_id):
        schema = ToolCalls([tool("f", p)]).to_json_schema().json_schema
        assert schema["items"]["properties"]["arguments"] == p and "$defs" not in schema


@pytest.mark.parametrize(
    "schema, where",
    [
        (
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "string"}}, "required": ["b"]},
                ]
            },
            "allOf with 2 branches at /",
        ),
        (
            {
                "type": "object",
                "properties": {"x": {"allOf": [{"type": "integer"}, {"type": "integer"}]}},
            },
            "allOf with 2 branches at /properties/x",
        ),
        (
            # optional: with "e" required no finite document exists (refused before any backend)
            {"type": "object", "properties": {"e": {"enum": []}}},
            "enum: [] at /properties/e",
        ),
    ],
)
def test_outlines_refuses_schemas_it_would_turn_into_non_json(schema, where):
    if "outlines" not in JSON_BACKENDS:
        pytest.skip("outlines-core not installed")
    with pytest.raises(
        UnsupportedGrammarError, match=f"^{re.escape(f'[outlines] {where}: outlines-core')}"
    ):
        backend("outlines").compile(JsonSchema(schema))


def test_outlines_single_allof_branch_and_optional_names_still_compile():
    """The refusals above are narrow: one allOf branch and ordinary names compile and enforce."""
    if "outlines" not in JSON_BACKENDS:
        pytest.skip("outlines-core not installed")
    one = JsonSchema(
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            ]
        }
    )
    assert _accepts("outlines", one, '{"a": 1}') and not _accepts("outlines", one, '{"a": "x"}')


@pytest.mark.parametrize("name", JSON_BACKENDS)
def test_property_names_needing_escapes_are_matched_to_their_schema(name):
    spec = GOOD["escaped-names"]
    good = {'a"b': 1, "c\\d": "x", "new\nline": True}
    assert _accepts(name, spec, json.dumps(good))
    # the names as outlines used to write them (not JSON), and a value of the wrong type
    assert not _accepts(name, spec, '{"a"b": 1, "c\\d": "x", "new\nline": true}')
    if name != "xgrammar":  # xgrammar: escaped names are additional properties (known_differences)
        assert not _accepts(name, spec, json.dumps({**good, 'a"b': "one"}))


@pytest.mark.model
def test_cli_batch_lines_with_odd_grammar_values_fail_alone(capsys, tmp_path):
    from spec_grammar.cli import main as cli_main

    lines = [
        {"prompt": "Say yes or no.", "regex": "(yes|no)"},
        {"prompt": "x", "ebnf": 5},
        {"prompt": "x", "lark": ["start: 'a'"]},
        {"prompt": "x", "json_schema": "s" * 300},
        {"prompt": "x", "tools": "t" * 300},
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps(x) for x in lines))
    code = cli_main(
        [
            "generate",
            "--max-new-tokens",
            "4",
            "--draft",
            "none",
            "--batch-file",
            str(batch),
            "--json",
        ]
    )
    results = json.loads(capsys.readouterr().out)["results"]
    assert code == 1 and [r["finish_reason"] == "error" for r in results] == [
        False,
        True,
        True,
        True,
        True,
    ]
    assert all(r["error"].startswith(f"{batch}:{i + 2}: ") for i, r in enumerate(results[1:])), (
        results
    )


@pytest.mark.parametrize(
    "schema, error, says",
    [
        (
            {
                "type": "object",
                "patternProperties": {"^x-": {"type": "string"}},
                "additionalProperties": False,
            },
            UnsupportedGrammarError,
            "json_schema: Unsupported JSON Schema structure false",
        ),
        (
            {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2},
            GrammarCompileError,
            "or a bound {m,n} with m > n (such as minItems > maxItems)",
        ),
        (
            # a pattern Python's re cannot read reaches outlines as written (one it can read but
            # that has look-around is left out with a warning)
            {"type": "string", "pattern": "\\p{L}(?<=a)b"},
            GrammarCompileError,
            "lacks (look-around, backreference)",
        ),
    ],
)
def test_outlines_compile_errors_are_one_line_and_name_the_cause(schema, error, says):
    """outlines' own text ends with multi-line "open an issue" advice, or says only "error
    building NFA": the request's error (printed one per batch line by the CLI) names the cause."""
    if "outlines" not in JSON_BACKENDS:
        pytest.skip("outlines-core not installed")
    with pytest.raises(error) as err:
        backend("outlines").compile(JsonSchema(schema))
    assert type(err.value) is error and says in str(err.value) and "\n" not in str(err.value), str(
        err.value
    )
    assert str(err.value).startswith("[outlines] json_schema")


def test_outlines_look_around_pattern_is_declared_and_refused_under_strict():
    """outlines-core's regex engine has no look-around: the pattern is left out with a warning
    naming it (the rest of the schema still enforced), and strict mode refuses the schema."""
    if "outlines" not in JSON_BACKENDS:
        pytest.skip("outlines-core not installed")
    schema = {"type": "string", "pattern": "(?<=a)b"}
    lenient = backend("outlines").compile(JsonSchema(schema))
    assert any(w.startswith("pattern") for w in lenient.warnings), lenient.warnings
    with pytest.raises(UnsupportedGrammarError, match="pattern"):
        backend("outlines").compile(JsonSchema(schema, strict=True))


DRAFT07_TUPLE = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "a": {
            "type": "array",
            "items": [{"type": "string"}, {"type": "boolean"}],
            "additionalItems": False,
        }
    },
    "required": ["a"],
    "additionalProperties": False,
}
DRAFT04_EXCLUSIVE = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {
        "n": {
            "type": "integer",
            "minimum": 0,
            "exclusiveMinimum": True,
            "maximum": 3,
            "exclusiveMaximum": False,
        }
    },
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("name", JSON_BACKENDS)
@pytest.mark.parametrize(
    "schema, docs",
    [
        (DRAFT07_TUPLE, [{"a": ["x", True]}, {"a": ["x"]}, {"a": ["x", True, 1]}, {"a": [1]}]),
        (DRAFT04_EXCLUSIVE, [{"n": 1}, {"n": 3}, {"n": 0}, {"n": 4}]),
    ],
)
def test_older_draft_forms_compile_and_agree_with_jsonschema(name, schema, docs):
    """Tuple ``items`` (draft 04-2019) and boolean ``exclusiveMinimum`` (draft 04): xgrammar
    refused both ("items must be a boolean or an object", "Value must be a number"). Backends
    that cannot express them must say so with a typed error; those that compile must agree with
    the schema's own draft."""
    spec = JsonSchema(schema)
    try:
        compiled = backend(name).compile(spec)
    except UnsupportedGrammarError:
        assert (
            name == "outlines" and schema is DRAFT07_TUPLE
        )  # outlines-core: "Unsupported ... structure"
        return
    if (
        name == "outlines" and schema is DRAFT04_EXCLUSIVE
    ):  # outlines ignores numeric bounds: it says so
        assert any(w.startswith("exclusiveMinimum at /properties/n") for w in compiled.warnings), (
            compiled.warnings
        )
        return
    check = jsonschema.validators.validator_for(schema)(schema)
    for doc in docs:
        assert _accepts(name, spec, json.dumps(doc)) == check.is_valid(doc), (name, doc)


@pytest.mark.parametrize("name", JSON_BACKENDS)
@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {"a": {"type": "string", "enum": ["x", None, 3]}},
            "required": ["a"],
            "additionalProperties": False,
        },
        {"type": "integer", "enum": [1.5, 2, "3"]},
        {"type": ["string", "null"], "enum": ["x", None, 3]},
    ],
    ids=["nested-string-enum", "integer-enum", "type-list-enum"],
)
def test_enum_values_outside_the_type_are_refused(name, schema):
    # JSON Schema asks for type AND enum; xgrammar and outlines let every listed value through
    for text in ['{"a": "x"}', '{"a": null}', '{"a": 3}', "2", "1.5", '"3"', '"x"', "null", "3"]:
        want = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert _accepts(name, JsonSchema(schema), text) == want, (name, schema, text)
