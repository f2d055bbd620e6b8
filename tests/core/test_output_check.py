"""The post-check (:mod:`spec_grammar.output_check`) against its oracles: ``jsonschema`` on the
user's schema, the tool list's own rules, ``re.fullmatch``; on the bundled corpora's documents
its verdict must be ``jsonschema``'s, labelled and unlabelled alike."""

from __future__ import annotations

import json

import jsonschema
import pytest

from spec_grammar.datasets import bfcl_cases, json_schema_test_suite
from spec_grammar.json_schema.limits import OutputLimits
from spec_grammar.output_check import check_output
from spec_grammar.specs import Ebnf, JsonSchema, Lark, Regex, ToolCalls

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}},
]


def test_schema_keywords_backends_leave_out_are_checked():
    spec = JsonSchema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert check_output(spec, "[1, 2]") == (True, [])
    valid, violations = check_output(spec, "[1, 1]")
    assert valid is False and violations[0].keyword == "uniqueItems" and violations[0].path == ""
    valid, violations = check_output(spec, '[1, "a"]')
    assert valid is False and violations[0].path == "/1" and violations[0].keyword == "type"


def test_the_check_uses_the_users_schema_not_the_limits_rewrite():
    """maxLength capped by the output limits is our rewrite: a longer string is still valid."""
    spec = JsonSchema({"type": "string"}, limits=OutputLimits(max_string_length=2))
    assert check_output(spec, json.dumps("abcdef")) == (True, [])


def test_not_json_and_dollar_as_ecma_reads_it():
    valid, violations = check_output(JsonSchema({"type": "object"}), '{"a": ')
    assert valid is False and violations[0].keyword == "json"
    spec = JsonSchema({"type": "string", "pattern": "^a$"})
    assert check_output(spec, '"a"')[0] is True
    assert check_output(spec, '"a\\n"')[0] is False  # Python's $ would pass it


def test_tool_calls_arguments_names_and_counts():
    required = ToolCalls(WEATHER)
    ok = '[{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}]'
    assert check_output(required, ok) == (True, [])
    valid, v = check_output(
        required, '[{"name": "weather", "arguments": {"city": "Oslo", "days": 0}}]'
    )
    assert valid is False and v[0].path == "/0/arguments/days" and v[0].keyword == "minimum"
    valid, v = check_output(required, '[{"name": "nope", "arguments": {}}]')
    assert valid is False and v[0].keyword == "name"
    assert check_output(required, "[]")[1][0].keyword == "tool_choice"
    named = ToolCalls(WEATHER, tool_choice="time")
    assert (
        check_output(named, '[{"name": "weather", "arguments": {"city": "x"}}]')[1][0].keyword
        == "name"
    )
    single = ToolCalls(WEATHER, parallel_tool_calls=False)
    two = '[{"name": "time", "arguments": {}}, {"name": "time", "arguments": {}}]'
    assert [x.keyword for x in check_output(single, two)[1]] == ["parallel_tool_calls"]
    assert [x.keyword for x in check_output(ToolCalls(WEATHER, max_tool_calls=1), two)[1]] == [
        "max_tool_calls"
    ]
    assert check_output(required, '[{"name": "time"}]')[1][0].keyword == "call"


def test_tagged_calls_and_free_text_under_auto():
    auto = ToolCalls(WEATHER, tool_choice="auto")
    assert check_output(auto, "No tool needed.") == (True, [])
    text = 'Sure. <tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    valid, v = check_output(auto, text)
    assert valid is False and v[0].keyword == "required" and v[0].path == "/0/arguments"
    cut = '<tool_call>{"name": "time", "arguments": {}}'
    assert check_output(auto, cut)[0] is False


def test_strict_functions_are_checked_as_openai_reads_them():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "strict": True,
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
    ]
    assert check_output(ToolCalls(tools), '[{"name": "f", "arguments": {}}]')[0] is False
    assert (
        check_output(ToolCalls(tools), '[{"name": "f", "arguments": {"a": "x", "b": 1}}]')[0]
        is False
    )


def test_regex_full_match_and_no_oracle_cases():
    assert check_output(Regex("[a-z]+"), "abc") == (True, [])
    assert check_output(Regex("[a-z]+"), "abc1")[0] is False
    assert check_output(Regex(r"\p{L}+"), "héllo")[0] is True  # the regex package's syntax
    assert check_output(Ebnf('root ::= "a"'), "b") == (None, [])
    assert check_output(Lark('start: "a"'), "b") == (None, [])
    assert check_output(None, "x") == (None, [])


def test_agrees_with_jsonschema_on_the_suite_and_bfcl():
    """Every labelled document of the bundled JSON-Schema-Test-Suite and every BFCL example
    output: the post-check's verdict is the label (``jsonschema``'s)."""
    n = 0
    for group in json_schema_test_suite():
        if group.get("needs_remote"):
            continue
        spec = JsonSchema(group["schema"])
        for t in group["tests"]:
            valid, _ = check_output(spec, json.dumps(t["data"]))
            try:
                want = jsonschema.validators.validator_for(
                    group["schema"], default=jsonschema.Draft202012Validator
                )(group["schema"]).is_valid(t["data"])
            except Exception:
                continue
            if "$" in json.dumps(group["schema"]) and t["valid"] != want:
                continue  # the ECMA `$` reading: covered by its own test above
            assert valid is t["valid"], (group["group_description"], t["description"])
            n += 1
    for case in bfcl_cases():
        spec = ToolCalls(case["tools"])
        if case.get("example_output") is None:
            continue
        valid, v = check_output(spec, json.dumps(case["example_output"]))
        assert valid is case["example_output_valid"], (case["id"], v)
        n += 1
    assert n > 1000


def test_an_oracle_that_cannot_check_tells_invalid_and_never_raises():
    """A remote ``$ref`` the oracle cannot resolve, a number past a float: ``valid`` False with
    an ``oracle`` violation, never an exception (a batch's other results would be lost)."""
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/x.json"}}}
    valid, v = check_output(JsonSchema(remote), '{"a": 5}')
    assert valid is False and v[0].keyword == "oracle" and "Unresolvable" in v[0].message
    valid, v = check_output(JsonSchema({"type": "number", "multipleOf": 0.5}), "1" + "0" * 400)
    assert valid is True  # decimal arithmetic holds any magnitude


@pytest.mark.parametrize(
    "schema,text,want",
    [
        # JSON's decimal numbers, not binary floats: 0.3 is a multiple of 0.1
        ({"type": "number", "multipleOf": 0.1}, "0.3", True),
        ({"type": "number", "multipleOf": 0.1}, "0.30000000000000004", False),
        ({"type": "integer", "multipleOf": 0.123456789}, "1e308", False),
        ({"type": "integer", "multipleOf": 3}, "9", True),
        # Unicode properties, as the backends read them (re cannot compile \p)
        ({"type": "string", "pattern": "^\\p{L}+$"}, '"Paris"', True),
        ({"type": "string", "pattern": "^\\p{L}+$"}, '"Par1s"', False),
    ],
)
def test_the_oracle_reads_numbers_and_patterns_as_json_schema_does(schema, text, want):
    assert check_output(JsonSchema(schema), text)[0] is want


def test_a_backtracking_pattern_is_decided_in_bounded_time():
    """``^(\\w+\\s?)+$`` backtracks exponentially in Python's re on a near-miss: the check
    answers (within the pattern timeout, here at once) instead of holding the process."""
    schema = {"type": "string", "pattern": "^(?!z)(\\w+\\s?)+$"}
    valid, _ = check_output(JsonSchema(schema), json.dumps("Supercalifragilisticexpialidocious."))
    assert valid is False
