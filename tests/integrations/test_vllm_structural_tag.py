"""vLLM's structural-tag requests (tool calls) as our tagged ``ToolCalls``, without vLLM: the
shapes vLLM 0.32 / 0.34's hermes tool parser sends (copied from
``vllm.tool_parsers.structural_tag_registry``'s output) and the legacy form. Oracle: what a
matcher of the compiled spec accepts, and the spec's own fields; shapes we cannot serve exactly
are refused by name."""

from __future__ import annotations

import json

import pytest

from spec_grammar.errors import GrammarSpecError, UnsupportedGrammarError
from spec_grammar.integrations.vllm.structural_tag import structural_tag_to_tool_calls

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def hermes_tags(name: str, schema) -> list[dict]:
    """The two layouts vLLM's hermes builder emits per function."""
    return [
        {
            "type": "tag",
            "begin": f'<tool_call>{nl}{{"name": "{name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "style": "json"},
            "end": "}" + nl + "</tool_call>",
        }
        for nl in ("\n", "")
    ]


def tag(fmt: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


REQUIRED = tag(
    {
        "type": "tags_with_separator",
        "tags": hermes_tags("add", ADD) + hermes_tags("now", True),
        "separator": "",
        "at_least_one": True,
        "stop_after_first": False,
    }
)
NAMED = tag(
    {
        "type": "tags_with_separator",
        "tags": hermes_tags("add", ADD),
        "separator": "",
        "at_least_one": True,
        "stop_after_first": True,
    }
)
AUTO = tag(
    {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": hermes_tags("add", ADD),
        "at_least_one": False,
        "stop_after_first": False,
        "excludes": [],
    }
)
LEGACY = json.dumps(
    {
        "type": "structural_tag",
        "structures": [
            {
                "begin": '<tool_call>{"name": "add", "arguments": ',
                "schema": ADD,
                "end": "}</tool_call>",
            }
        ],
        "triggers": ["<tool_call>"],
    }
)


@pytest.mark.parametrize(
    ("text", "choice", "parallel", "names"),
    [
        (REQUIRED, "required", True, ["add", "now"]),
        (NAMED, "required", False, ["add"]),
        (AUTO, "auto", True, ["add"]),
        (LEGACY, "auto", True, ["add"]),
    ],
    ids=["required", "named", "auto", "legacy"],
)
def test_hermes_tags_become_tagged_tool_calls(text, choice, parallel, names):
    spec = structural_tag_to_tool_calls(text, whitespace="flexible")
    assert spec.call_format == "tagged" and (spec.call_open, spec.call_close) == (
        "<tool_call>",
        "</tool_call>",
    )
    assert spec.tool_choice == choice and spec.parallel_tool_calls is parallel
    assert [f["name"] for f in spec.functions()] == names
    by_name = {f["name"]: f["parameters"] for f in spec.functions()}
    assert by_name["add"] == ADD
    if "now" in by_name:  # vLLM's "any arguments" (a non-strict tool): an object
        assert by_name["now"] == {"type": "object"}


SPACED = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
CALLS = [  # (text, accepted under flexible, accepted under compact)
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>', True, False),
    (SPACED, True, False),
    ('<tool_call>{"name":"add","arguments":{"a":2}}</tool_call>', True, True),
    (SPACED.replace("add", "sub"), False, False),
    (SPACED.replace("2", '"2"'), False, False),
]


@pytest.fixture(scope="module")
def backends(tok):
    """One backend per name, built on first use (a vocabulary scan each)."""
    from spec_grammar.registry import get_backend

    made = {}

    def get(name):
        pytest.importorskip(f"spec_grammar_{name}")
        if name not in made:
            made[name] = get_backend(name, tok)
        return made[name]

    return get


@pytest.mark.slow  # a backend's vocabulary scan: ~10 s on a loaded 2-core host
@pytest.mark.parametrize("whitespace", ["flexible", "compact"])
@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_calls_in_both_hermes_layouts_are_accepted(tok, backends, name, whitespace):
    """The request's matcher (:func:`spec_grammar.compose.matcher`, what our vLLM backend
    serves: the tags around one call's JSON; ``backend.matcher`` alone is the call's JSON)
    takes a call in both of vLLM's hermes layouts under ``flexible`` and only the compact
    spelling under ``compact``, and refuses an unknown function or ill-typed arguments."""
    from spec_grammar.compose import matcher

    backend = backends(name)
    for text_of in (NAMED, REQUIRED, AUTO, LEGACY):
        compiled = backend.compile(structural_tag_to_tool_calls(text_of, whitespace=whitespace))
        for text, flexible_ok, compact_ok in CALLS:
            ok = flexible_ok if whitespace == "flexible" else compact_ok
            ids = tok.encode(text) + [tok.eos_token_id]
            m = matcher(backend, compiled)
            assert (m.accept_tokens(ids) == len(ids) and m.is_terminated()) is ok, text


@pytest.mark.parametrize(
    ("fmt", "match"),
    [
        ({"type": "any_text"}, "format type 'any_text'"),
        (
            {"type": "tags_with_separator", "tags": hermes_tags("add", ADD), "separator": ","},
            "without at_least_one",
        ),
        (
            {
                "type": "tag",
                "begin": "<function=add>",
                "content": {"type": "json_schema", "json_schema": ADD},
                "end": "</function>",
            },
            "is not OPEN",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<tool_call>"],
                "tags": hermes_tags("add", ADD) + hermes_tags("add", {"type": "object"}),
            },
            "two schemas",
        ),
        (
            {
                "type": "tag",
                "begin": '<tool_call>{"name": "add", "arguments": ',
                "content": {"type": "json_schema", "json_schema": ADD, "style": "qwen_xml"},
                "end": "}</tool_call>",
            },
            "style 'qwen_xml'",
        ),
    ],
)
def test_other_shapes_are_refused_by_name(fmt, match):
    with pytest.raises(UnsupportedGrammarError, match=match):
        structural_tag_to_tool_calls(tag(fmt), whitespace="flexible")


def test_malformed_structural_tags_are_spec_errors():
    with pytest.raises(GrammarSpecError, match="not valid JSON"):
        structural_tag_to_tool_calls("{", whitespace="flexible")
    with pytest.raises(GrammarSpecError, match="neither"):
        structural_tag_to_tool_calls("{}", whitespace="flexible")
