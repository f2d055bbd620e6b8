"""OpenAI-shaped input and output of the Python API (issue 24): ``messages`` lists and
``system``, pydantic model classes as grammars, ``finish_reason`` in OpenAI's vocabulary with
the worker's finer ``finish_detail``, results as chat-completion messages, and streaming
(``on_chunk`` / :func:`~spec_grammar.worker.api.stream`).

The oracles: the tokenizer's own ``apply_chat_template``, pydantic's validation, a fresh
matcher replaying the output, and the non-streamed result of the same run."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

from spec_grammar.specs import JsonSchema, Regex, ToolCalls, as_grammar_spec
from spec_grammar.worker import api
from spec_grammar.worker.request import Request, check_request, finish_reason_of
from spec_grammar.worker.sampling import SamplingParams


class City(BaseModel):
    name: str
    country: str


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def test_messages_go_through_the_chat_template(tok):
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Another."},
    ]
    want = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert api.build_prompt(tok, turns) == list(want)
    assert api.build_prompt(tok, turns[1:2], system="Be brief.") == api.build_prompt(tok, turns[:2])
    assert api.build_prompt(tok, "Name a city.", system="Be brief.") == api.build_prompt(
        tok, turns[:2]
    )


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([], "non-empty list"),
        ([{"role": "tool", "content": "x"}], "messages[0]: role 'tool'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], "messages[1]: content"),
        ([{"role": "user", "content": "x", "extra": 1}], "messages[0] must be an object"),
    ],
)
def test_bad_messages_are_named_before_the_model_loads(monkeypatch, messages, needle):
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError) as e:
        api.generate(messages=messages)
    assert needle in str(e.value)


def test_pydantic_model_classes_are_grammars():
    want = JsonSchema(City.model_json_schema())
    assert as_grammar_spec(City) == want
    req = Request(prompt="x", grammar=City)
    check_request(req)
    assert req.grammar == want
    assert "country" in api.schema_prompt(City, "Name a city.")
    with pytest.raises(TypeError, match="pydantic model class"):
        as_grammar_spec(object)


def test_finish_reason_in_openai_vocabulary():
    tools = ToolCalls(TOOLS)
    assert finish_reason_of("grammar", tools) == "tool_calls"
    assert finish_reason_of("grammar", Regex("a")) == "stop"
    assert finish_reason_of("eos", None) == finish_reason_of("stop_string", None) == "stop"
    assert finish_reason_of("length", Regex("a")) == "length"


@pytest.mark.model
def test_pydantic_grammar_streams_and_the_chunks_are_the_result():
    chunks = []
    [res] = api.generate(
        messages=[
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Name a city in France."},
        ],
        grammar=City,
        schema_in_prompt=True,
        max_new_tokens=48,
        on_chunk=chunks.append,
    )
    assert res.finish_reason == "stop" and res.finish_detail == "grammar", res
    City.model_validate_json(res.text)  # the oracle: pydantic itself
    assert "".join(c.text for c in chunks) == res.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == res.finish_reason
    assert chunks[-1].valid is res.valid is True
    assert 2 <= len(chunks) <= res.steps + 1  # one chunk per step at most, not one at the end
    assert res.message() == {"role": "assistant", "content": res.text}
    again = list(
        api.stream(
            messages=[
                {"role": "system", "content": "Answer in JSON."},
                {"role": "user", "content": "Name a city in France."},
            ],
            grammar=City,
            schema_in_prompt=True,
            max_new_tokens=48,
        )
    )
    # greedy: the iterator yields the same text, ending the same way (another request id; where
    # the chunks split follows each step's accepted run, which the draft budget's timing-driven
    # cuts may move)
    assert "".join(c.text for c in again) == res.text
    assert [c.finish_reason for c in again][-1] == res.finish_reason
    assert all(c.finish_reason is None for c in again[:-1])


@pytest.mark.model
def test_tool_calls_read_as_an_openai_message():
    [res] = api.generate(
        "What is the weather in Paris?",
        grammar=ToolCalls(TOOLS),
        schema_in_prompt=True,
        max_new_tokens=64,
    )
    assert res.finish_reason == "tool_calls" and res.finish_detail == "grammar", res
    msg = res.message()
    assert msg["role"] == "assistant" and msg["content"] is None
    for call, raw in zip(msg["tool_calls"], json.loads(res.text)):
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == raw["arguments"]


def test_stream_raises_the_runs_error(monkeypatch):
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(TypeError, match="unexpected keyword"):
        list(api.stream("hi", nonsense=1))


@pytest.mark.model
def test_the_last_streamed_chunk_says_whether_the_output_is_valid():
    """A stream's last chunk comes before the run's results: it carries the result's ``valid``
    (was always None, so a streaming user was not told that an output broke its schema). The
    schema asks for two equal unique items: xgrammar cannot enforce ``uniqueItems``, so every
    completed output breaks it; jsonschema is the oracle."""
    unique = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2}
    unique["uniqueItems"] = True
    for grammar, prompt, want in [(unique, "Two ones.", False), (Regex("(yes|no)"), "Wet?", True)]:
        chunks = list(api.stream(prompt, grammar=grammar, max_new_tokens=64))
        text = "".join(c.text for c in chunks)
        assert [c.valid for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "stop" and chunks[-1].valid is want, chunks
        if isinstance(grammar, dict):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(json.loads(text), grammar)


def test_a_stream_of_refused_requests_still_ends_each_with_its_chunk():
    """Every request refused before the model loads: the stream yielded nothing (the early
    return came before the stream existed); each now gets its one final chunk, the error."""
    chunks = list(api.stream(["hi", "ho"], grammar={"type": "nonsense"}))
    assert [c.finish_reason for c in chunks] == ["error", "error"]
    assert len({c.rid for c in chunks}) == 2 and all(c.text == "" for c in chunks)


@pytest.mark.model
def test_an_unhashable_request_id_ends_only_its_request_when_streaming():
    """``rid in self._done`` ran before the id's type check: a list id raised TypeError in the
    stream and took the batch down (plain ``generate`` ended only that request)."""
    good = Request("Say hi.", sampling=SamplingParams(max_new_tokens=4))
    chunks = list(api.stream([Request("Hi", rid=["a"]), good]))
    finals = [c for c in chunks if c.finish_reason is not None]
    assert sorted(c.finish_reason for c in finals) == ["error", "length"]
    assert "".join(c.text for c in chunks if c.rid == good.rid) != ""
