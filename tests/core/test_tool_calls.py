"""Tool calls with OpenAI semantics on every backend: ``tool_choice`` (required / auto / named),
``parallel_tool_calls``, ``max_tool_calls``, ``strict`` functions, and the tagged format
(``<tool_call>...</tool_call>``) whose opening tag is found however it is split into tokens.

Oracles: jsonschema on the parsed calls and on the call schema, fresh-matcher replay for
rollback and for draft-tree rows."""

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import check_tree_against_replay, row_of

from spec_grammar import ToolCalls, get_backend
from spec_grammar.compose import matcher as compose_matcher
from spec_grammar.errors import GrammarSpecError
from spec_grammar.reasoning import ReasoningGrammar
from spec_grammar.specs import openai_strict
from spec_grammar.tool_calls import TaggedToolCalls, parse_tool_calls
from spec_grammar.vocab import encode_ids

BACKENDS = ["xgrammar", "llguidance", "outlines"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
TOOLS = [WEATHER, ADD]
CALL_ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
CALL_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tok):
    return get_backend(request.param, tok)


def matcher(backend, **spec):
    return compose_matcher(backend, backend.compile(ToolCalls(TOOLS, **spec)))


def accepts_all(m, text, tok, *, end: bool = True) -> bool:
    """``text`` (one string, or pieces tokenized one by one as a model writes them under the
    mask: tags and JSON apart) and then EOS are accepted whole."""
    pieces = [text] if isinstance(text, str) else text
    ids = [t for piece in pieces for t in encode_ids(tok, piece)]
    if m.accept_tokens(ids) != len(ids):
        return False
    return m.accept_token(tok.eos_token_id) if end else True


def tool_schema(name: str) -> dict:
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    params = fn["parameters"]
    return openai_strict(params) if fn.get("strict") else params


def test_spec_checks_openai_choices():
    assert (
        ToolCalls(TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}).tool_choice
        == "add"
    )
    for bad, needle in [
        (dict(tool_choice="none"), "without a ToolCalls"),
        (dict(tool_choice="nope"), "not in tools"),
        (dict(tool_choice="auto", format="json_array"), "tagged"),
        (dict(max_tool_calls=0), "max_tool_calls"),
        (dict(call_open=""), "call_open"),
    ]:
        with pytest.raises(GrammarSpecError, match=needle):
            ToolCalls(TOOLS, **bad)
    assert ToolCalls(TOOLS, tool_choice="auto").call_format == "tagged"
    assert ToolCalls(TOOLS, parallel_tool_calls=False, max_tool_calls=5).max_calls == 1
    # two functions of one name: a call could not say whose arguments' schema it follows
    with pytest.raises(GrammarSpecError, match="both named"):
        ToolCalls(TOOLS + TOOLS[:1])


def test_strict_function_schema_is_openais():
    schema = openai_strict(ADD["function"]["parameters"])
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid({"a": 1, "b": 2})
    assert not v.is_valid({"a": 1})
    assert not v.is_valid({"a": 1, "b": 2, "c": 3})


@pytest.mark.parametrize("fmt", ["json_array", "tagged"])
def test_openai_semantics_are_enforced(backend, tok, fmt):
    def wrap(*calls):
        if fmt == "json_array":
            return "[" + ", ".join(calls) + "]"
        return [p for c in calls for p in ("<tool_call>", c, "</tool_call>")]

    assert accepts_all(matcher(backend, format=fmt), wrap(CALL_ADD, CALL_WEATHER), tok)
    # strict: no extra key, every property required, no key twice
    for args in ('{"a": 1, "b": 2, "c": 3}', '{"a": 1}', '{"a": 1, "a": 2}'):
        call = '{"name": "add", "arguments": ' + args + "}"
        assert not accepts_all(matcher(backend, format=fmt), wrap(call), tok), args
    # a function nobody named, an unknown function
    assert not accepts_all(matcher(backend, format=fmt, tool_choice="add"), wrap(CALL_WEATHER), tok)
    assert accepts_all(matcher(backend, format=fmt, tool_choice="add"), wrap(CALL_ADD), tok)
    unknown = '{"name": "rm_rf", "arguments": {}}'
    assert not accepts_all(matcher(backend, format=fmt), wrap(unknown), tok)
    # one call only, and a bound on the number of calls
    assert accepts_all(matcher(backend, format=fmt, parallel_tool_calls=False), wrap(CALL_ADD), tok)
    assert not accepts_all(
        matcher(backend, format=fmt, parallel_tool_calls=False), wrap(CALL_ADD, CALL_ADD), tok
    )
    assert accepts_all(
        matcher(backend, format=fmt, max_tool_calls=2), wrap(CALL_ADD, CALL_ADD), tok
    )
    assert not accepts_all(
        matcher(backend, format=fmt, max_tool_calls=2), wrap(CALL_ADD, CALL_ADD, CALL_ADD), tok
    )
    # required: no call at all is not an answer
    m = matcher(backend, format=fmt)
    assert not m.accept_token(tok.eos_token_id)


def test_auto_allows_text_calls_and_ends_anywhere(backend, tok):
    spec = ToolCalls(TOOLS, tool_choice="auto")
    for pieces in [
        ["The weather is fine."],
        ["Let me check. <tool_call>", CALL_WEATHER, "</tool_call>"],
        [
            "<tool_call>",
            CALL_ADD,
            "</tool_call>",
            " and <tool_call>",
            CALL_WEATHER,
            "</tool_call>",
            " done.",
        ],
        ["<tool_call>\n", CALL_ADD, "</tool_call>"],
        ["<tool_call>", "\n", CALL_ADD, "\n", "</tool_call>", "\n"],
    ]:
        m = compose_matcher(backend, backend.compile(spec))
        assert isinstance(m, TaggedToolCalls)
        assert accepts_all(m, pieces, tok), pieces
        content, calls = parse_tool_calls("".join(pieces), spec)
        assert m.num_calls == len(calls)
        for call in calls:
            jsonschema.validate(call["arguments"], tool_schema(call["name"]))
    # after the tag, only a valid call; an unclosed call cannot end
    m = compose_matcher(backend, backend.compile(spec))
    assert not accepts_all(m, "<tool_call>hello", tok)
    m = compose_matcher(backend, backend.compile(spec))
    assert not accepts_all(m, '<tool_call>{"name": "add"', tok)


def test_tag_split_over_any_tokens_is_found(backend, tok):
    """The opening tag written byte by byte (one token per byte), and a tag ending inside a
    token with more text after it: the first is a call, the second is refused in free text."""
    spec = ToolCalls(TOOLS, tool_choice="auto")
    m = compose_matcher(backend, backend.compile(spec))
    info = m.info
    byte_ids = {b: i for i, b in enumerate(info.token_bytes) if len(b) == 1}
    assert m.accept_tokens(encode_ids(tok, "ok "))
    assert m.accept_tokens([byte_ids[bytes([c])] for c in b"<tool_call>"]) == len("<tool_call>")
    assert not m.accept_tokens(encode_ids(tok, "hello"))  # inside a call now
    assert accepts_all(m, [CALL_ADD, "</tool_call>"], tok)

    m = compose_matcher(backend, backend.compile(spec))
    assert m.accept_tokens(encode_ids(tok, "<tool_call"))
    joined = next(i for i, b in enumerate(info.token_bytes) if b.startswith(b">") and b[1:].strip())
    assert not m.accept_token(joined)
    assert not (row_of(m)[joined >> 5] >> (joined & 31)) & 1


def test_rollback_across_calls_equals_replay(backend, tok):
    spec = ToolCalls(TOOLS, tool_choice="auto")
    pieces = [
        "a <tool_call>",
        CALL_ADD,
        "</tool_call>",
        " b <tool_call>",
        CALL_WEATHER,
        "</tool_call>",
    ]
    seq = [t for p in pieces for t in encode_ids(tok, p)]
    m = compose_matcher(backend, backend.compile(spec))
    assert m.accept_tokens(seq) == len(seq)
    for k in range(1, len(seq) + 1):
        f = m.fork()
        f.rollback(k)
        fresh = compose_matcher(backend, backend.compile(spec))
        assert fresh.accept_tokens(seq[: len(seq) - k]) == len(seq) - k
        assert (row_of(f) == row_of(fresh)).all(), k
        assert f.forced_tokens() == fresh.forced_tokens()
        assert f.accept_tokens(seq[len(seq) - k :]) == k
    assert (row_of(m) == row_of(m.fork())).all()


def test_required_tagged_forces_the_tag(backend, tok):
    m = matcher(backend, format="tagged")
    assert m.forced_tokens() == list(encode_ids(tok, "<tool_call>"))
    assert not m.accept_tokens(encode_ids(tok, "Hi"))


def test_reasoning_then_auto_tool_calls(backend, tok):
    spec = ToolCalls(TOOLS, tool_choice="auto")
    m = ReasoningGrammar(compose_matcher(backend, backend.compile(spec)), "</think>")
    text = [
        f"I should call add. <tool_call>{CALL_WEATHER}</tool_call></think>",
        "Result: <tool_call>",
        CALL_ADD,
        "</tool_call>",
    ]
    assert accepts_all(m, text, tok)
    assert m.inner.num_calls == 1  # the call written while reasoning was not a call


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_tree_rows_around_tags_equal_replay(backend, tok, data):
    spec = ToolCalls(TOOLS, tool_choice="auto", max_tool_calls=2)
    compiled = backend.compile(spec)
    pieces = ["hi <tool_call>", CALL_ADD, "</tool_call>", " <tool_call>", CALL_ADD, "</tool_call>"]
    full = [t for p in pieces for t in encode_ids(tok, p)]
    pool = sorted(set(full) | {tok.eos_token_id})
    prefix = full[: data.draw(st.integers(0, len(full) - 1), label="prefix")]
    rest = full[len(prefix) :]
    chain = data.draw(st.integers(0, min(len(rest), 8)), label="chain")
    n = chain + 1 + data.draw(st.integers(0, 8), label="branches")
    parents = (
        [-1] + list(range(chain)) + [data.draw(st.integers(0, i - 1)) for i in range(chain + 1, n)]
    )
    tokens = [0] + rest[:chain] + [data.draw(st.sampled_from(pool)) for _ in range(chain + 1, n)]
    check_tree_against_replay(lambda: compose_matcher(backend, compiled), prefix, tokens, parents)


def test_parse_tool_calls_reads_both_formats():
    arr = ToolCalls(TOOLS)
    assert parse_tool_calls(f"[{CALL_ADD}]", arr) == (None, [json.loads(CALL_ADD)])
    tagged = ToolCalls(TOOLS, tool_choice="auto")
    assert parse_tool_calls("just text", tagged) == ("just text", [])
    with pytest.raises(ValueError):
        parse_tool_calls('<tool_call>{"name": </tool_call>', tagged)


def test_bad_tags_and_choices_are_typed_errors(backend, tok):
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    for tags in (
        dict(call_open=" "),
        dict(call_open="\n"),
        dict(call_close=eos),
        dict(call_open=eos),
    ):
        with pytest.raises(GrammarSpecError):
            compose_matcher(backend, backend.compile(ToolCalls(TOOLS, tool_choice="auto", **tags)))
    named = [{"type": "function", "function": {"name": "auto"}}, ADD]
    with pytest.raises(GrammarSpecError, match="cannot be chosen by name"):
        ToolCalls(named, tool_choice={"type": "function", "function": {"name": "auto"}})
    for bad in (dict(max_tool_calls=True), dict(parallel_tool_calls="no")):
        with pytest.raises(GrammarSpecError):
            ToolCalls(TOOLS, **bad)


def test_tag_ending_in_whitespace_opens_a_call(backend, tok):
    """Hermes writes ``<tool_call>\\n``: a tag with its own trailing newline is still a tag."""
    spec = ToolCalls(TOOLS, tool_choice="auto", call_open="<tool_call>\n")
    m = compose_matcher(backend, backend.compile(spec))
    assert m.accept_tokens(encode_ids(tok, "hi <tool_call>\n")) and m.accept_tokens(
        encode_ids(tok, CALL_ADD)
    )
    assert m.accept_tokens(encode_ids(tok, "</tool_call>")) and m.num_calls == 1
    assert not accepts_all(
        compose_matcher(backend, backend.compile(spec)), ["<tool_call>\n", "not json"], tok
    )


@pytest.mark.parametrize("tag", ["<tool_call>", "{", "::"])
def test_free_text_never_hides_a_tag_inside_a_token(tok, tag):
    """Every token holding the tag with more than whitespace after it is banned from free text
    (the whole vocabulary checked, a tag anywhere inside a token included)."""
    b = get_backend("xgrammar", tok)
    m = compose_matcher(b, b.compile(ToolCalls(TOOLS, tool_choice="auto", call_open=tag)))
    row = row_of(m)
    raw = tag.encode()
    for t, piece in enumerate(m.info.token_bytes):
        at = piece.find(raw)
        if at >= 0 and piece[at + len(raw) :].strip():
            assert not (row[t >> 5] >> (t & 31)) & 1, piece


def test_parse_reads_calls_as_the_grammar_does(backend, tok):
    spec = ToolCalls(TOOLS, tool_choice="auto")
    call = '{"name": "get_weather", "arguments": {"city": "</tool_call>"}}'
    assert accepts_all(
        compose_matcher(backend, backend.compile(spec)), ["<tool_call>", call, "</tool_call>"], tok
    )
    assert parse_tool_calls(f"<tool_call>{call}</tool_call>", spec)[1] == [json.loads(call)]
    with pytest.raises(ValueError, match="not closed"):
        parse_tool_calls(f"Sure <tool_call>{CALL_ADD}", spec)
    with pytest.raises(ValueError):
        parse_tool_calls('Sure <tool_call>{"name": "f", "argu', spec)


def test_deep_trees_past_the_kept_state_are_a_typed_error(tok):
    from spec_grammar import DraftTree, GrammarStateError, allocate_token_bitmask

    b = get_backend("xgrammar", tok, max_rollback_tokens=8)
    m = compose_matcher(b, b.compile(ToolCalls(TOOLS, tool_choice="auto")))
    word = encode_ids(tok, " a")[0]
    n = m.max_rollback_tokens + 100
    tree = DraftTree.from_parents([0] + [word] * (n - 1), [-1] + list(range(n - 1)))
    with pytest.raises(GrammarStateError):
        m.fill_tree_bitmask(tree, allocate_token_bitmask(n, m.info.vocab_size))
