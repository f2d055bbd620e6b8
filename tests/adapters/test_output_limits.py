"""Output limits (issue #20 part 4) on every built-in backend: the grammar refuses the token that
would write the 1+limit-th character / digit / item / whitespace, documents within the limits
are accepted, random walks over the grammar's own rows never produce a document past them (a
fresh matcher replays each), user bounds are kept, and what a backend cannot enforce is
declared on the compile."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from spec_grammar import get_backend
from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from spec_grammar.errors import UnsupportedGrammarError
from spec_grammar.json_schema.limits import OutputLimits, cap_lengths
from spec_grammar.specs import JsonSchema, ToolCalls

BACKENDS = ["xgrammar", "llguidance", "outlines"]

LIMITS = OutputLimits(max_whitespace=2, max_digits=3, max_string_length=4, max_items=2)
SCHEMA = {
    "type": "object",
    "properties": {
        "s": {"type": "string"},
        "n": {"type": "number"},
        "i": {"type": "integer"},
        "a": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["s", "n", "i", "a"],
    "additionalProperties": False,
}

# (limit, prefix, a character the grammar still takes there, the character past the limit)
AT_LIMIT = [
    ("max_string_length", '{"s": "aaaa', '"', "a"),  # 4 string characters
    ("max_digits", '{"s": "a", "n": 111', ".", "1"),  # 3 integer digits of a number
    ("max_digits", '{"s": "a", "n": -111', ".", "1"),
    ("max_digits", '{"s": "a", "n": 1, "i": 111', ",", "1"),  # 3 digits of an integer
    ("max_digits", '{"s": "a", "n": 1, "i": -111', ",", "1"),
    ("max_items", '{"s": "a", "n": 1, "i": 1, "a": [1, 2', "]", ","),  # 2 items
]
FRACTION = ('{"s": "a", "n": 1.111', ",", "1")  # 3 fraction digits


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tok):
    pytest.importorskip({"outlines": "outlines_core"}.get(request.param, request.param))
    return get_backend(request.param, tok)


def _char_ids(tok, text: str) -> list[int]:
    """One token per character (SmolLM2 has a token for each ASCII character)."""
    ids = []
    for c in text:
        [t] = tok.encode(c, add_special_tokens=False)
        ids.append(t)
    return ids


def _after(backend, tok, spec, text: str):
    m = backend.matcher(backend.compile(spec))
    ids = _char_ids(tok, text)
    assert m.accept_tokens(ids) == len(ids), f"{backend.name} refused part of {text!r}"
    return m


def _takes(m, tok, char: str) -> bool:
    [t] = _char_ids(tok, char)
    ok = m.accept_token(t)
    if ok:
        m.rollback(1)
    return ok


def _declared(compiled, limit: str) -> bool:
    return any(w.startswith(f"{limit} at /") for w in compiled.warnings)


@pytest.mark.parametrize("limit,prefix,ok,past", AT_LIMIT)
def test_grammar_refuses_the_token_past_each_limit(backend, tok, limit, prefix, ok, past):
    spec = JsonSchema(SCHEMA, limits=LIMITS)
    if limit not in backend.schema_caps and limit in ("max_string_length", "max_items"):
        # left out of this backend's schemas (outlines: its index would grow with the cap)
        assert _declared(backend.compile(spec), limit)
        return
    m = _after(backend, tok, spec, prefix)
    assert _takes(m, tok, ok)
    assert not _takes(m, tok, past)
    # the row agrees with accept: no allowed token starts with the refused character
    bm = allocate_token_bitmask(1, backend.vocab_size)
    m.fill_next_token_bitmask(bm, 0)
    allowed = allowed_token_ids(bm[0], backend.vocab_size)
    token_bytes = backend.tokenizer_info.token_bytes
    assert not any(token_bytes[t][:1] == past.encode() for t in allowed)
    # without limits the same character is taken: the limit, not the schema, refuses it
    assert _takes(_after(backend, tok, JsonSchema(SCHEMA), prefix), tok, past)


def test_fraction_digits_bounded_or_declared(backend, tok):
    prefix, ok, past = FRACTION
    compiled = backend.compile(JsonSchema(SCHEMA, limits=LIMITS))
    m = _after(backend, tok, JsonSchema(SCHEMA, limits=LIMITS), prefix)
    assert _takes(m, tok, ok)
    if _takes(m, tok, past):  # xgrammar writes 6 fraction digits in a bounded number
        assert any(w.startswith("max_digits at /") for w in compiled.warnings), compiled.warnings
    else:
        assert not any(w.startswith("max_digits") for w in compiled.warnings)


def test_whitespace_runs_bounded(backend, tok):
    spec = JsonSchema(SCHEMA, whitespace="flexible", limits=LIMITS)
    for ws in (" ", "\n"):
        m = _after(backend, tok, spec, "{")
        run = 0
        while run < 10 and _takes(m, tok, ws):
            m.accept_token(_char_ids(tok, ws)[0])
            run += 1
        assert 1 <= run <= LIMITS.max_whitespace or (backend.name == "outlines" and run <= 1)
        if backend.name != "outlines":  # outlines writes at most one space in every policy
            assert run == LIMITS.max_whitespace, (ws, run)
        assert _takes(m, tok, '"')


def test_documents_within_limits_accepted(backend, tok):
    doc = '{"s": "abcd", "n": -123.5, "i": -999, "a": [0, 999]}'
    m = _after(backend, tok, JsonSchema(SCHEMA, limits=LIMITS), doc)
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    flexible = '{  "s":"ab" ,\n\n"n": 1, "i": 0, "a": []}'
    if backend.name != "outlines":
        m = _after(backend, tok, JsonSchema(SCHEMA, whitespace="flexible", limits=LIMITS), flexible)
        assert m.accept_token(tok.eos_token_id)


def test_user_bounds_kept(backend, tok):
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 9},
            "t": {"type": "string", "minLength": 6},
            "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
            "i": {"type": "integer", "minimum": 100000},
        },
        "required": ["s", "t", "a", "i"],
        "additionalProperties": False,
    }
    doc = '{"s": "aaaaaaaaa", "t": "bbbbbb", "a": [1, 2, 3, 4, 5], "i": 100001}'
    m = _after(backend, tok, JsonSchema(schema, limits=LIMITS), doc)
    assert m.accept_token(tok.eos_token_id)
    if backend.name == "outlines":  # one digit bound for every number: raised, and said so
        warnings = backend.compile(JsonSchema(schema, limits=LIMITS)).warnings
        assert any(w.startswith("max_digits at /properties/i") for w in warnings), warnings
    # the minLength above the cap is the string's bound: 7 characters are refused
    if "max_string_length" not in backend.schema_caps:
        return
    m = _after(backend, tok, JsonSchema(schema, limits=LIMITS), '{"s": "a", "t": "bbbbbb')
    assert not _takes(m, tok, "b")


def _json_runs_ok(text: str, limits: OutputLimits, fraction_digits: int) -> list[str]:
    """What in ``text`` goes past ``limits`` (outside strings: whitespace runs; numbers: digit
    runs of the integer part and, up to ``fraction_digits``, the fraction)."""
    problems = []
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    for run in re.findall(r"[ \t\n\r]+", outside):
        if len(run) > limits.max_whitespace:
            problems.append(f"whitespace run {run!r}")
    for num in re.findall(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", outside):
        whole, _, rest = num.lstrip("-").partition(".")
        frac = re.split(r"[eE]", rest)[0] if rest else ""
        if len(re.split(r"[eE]", whole)[0]) > limits.max_digits or len(frac) > fraction_digits:
            problems.append(f"number {num}")
    return problems


@pytest.mark.integration  # random walks over real schemas
def test_random_walks_never_pass_the_limits(backend, tok):
    """Random walks over the grammar's rows (half the steps prefer tokens that extend a run:
    digits, spaces, letters, commas), each document replayed on a fresh matcher and checked:
    complete, valid under the capped schema (jsonschema), runs within the limits."""
    spec = JsonSchema(SCHEMA, whitespace="flexible", limits=LIMITS)
    compiled = backend.compile(spec)
    capped = cap_lengths(SCHEMA, LIMITS) if "max_items" in backend.schema_caps else SCHEMA
    if "max_items" not in backend.schema_caps:  # declared instead; bounded for this walk
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"]}}
        schema["properties"]["s"] = {"type": "string", "maxLength": 4}
        schema["properties"]["a"] = {**SCHEMA["properties"]["a"], "maxItems": 2}
        compiled = backend.compile(JsonSchema(schema, whitespace="flexible", limits=LIMITS))
        capped = schema
    fraction = 6 if any(w.startswith("max_digits") for w in compiled.warnings) else 3
    runaway = set(_char_ids(tok, "1a ,\n"))
    rng = random.Random(20)
    bm = allocate_token_bitmask(1, backend.vocab_size)
    eos = tok.eos_token_id
    for _ in range(12):
        m = backend.matcher(compiled)
        ids: list[int] = []
        while not m.is_terminated() and len(ids) < 400:
            m.fill_next_token_bitmask(bm, 0)
            allowed = allowed_token_ids(bm[0], backend.vocab_size)
            eager = [t for t in allowed if t in runaway]
            t = rng.choice(eager if eager and rng.random() < 0.6 else allowed)
            assert m.accept_token(t)
            if t != eos:
                ids.append(t)
        assert m.is_terminated(), f"{backend.name}: no end after 400 tokens"
        replay = backend.matcher(compiled)
        assert replay.accept_tokens(ids + [eos]) == len(ids) + 1
        text = tok.decode(ids)
        doc = json.loads(text)
        jsonschema.validate(doc, capped, cls=jsonschema.Draft202012Validator)
        assert _json_runs_ok(text, LIMITS, fraction) == [], text


def test_tool_calls_get_the_item_cap(backend, tok):
    # declared parameters: an open `{"type": "object"}` takes outlines ~40 s to compile
    params = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    spec = ToolCalls(tools, limits=OutputLimits(max_items=1))
    if "max_items" not in backend.schema_caps:
        # the calls array carries maxItems already (max_calls): the limit bounds nothing
        # there, so it is not declared; an open array in the arguments is
        assert not _declared(backend.compile(spec), "max_items")
        listed = {**params, "properties": {"xs": {"type": "array", "items": {"type": "null"}}}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": listed}}]
        assert _declared(
            backend.compile(ToolCalls(tools, limits=OutputLimits(max_items=1))), "max_items"
        )
        return
    m = _after(backend, tok, spec, '[{"name": "f", "arguments": {}}')
    assert not _takes(m, tok, ",") and _takes(m, tok, "]")


def test_strict_schema_with_limits_compiles(backend):
    # the caps' own declarations (xgrammar: a bounded string has no escapes) are warnings, not
    # strict-mode refusals: strict is about the user's schema
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    if backend.name == "outlines":
        schema["additionalProperties"] = False
    compiled = backend.compile(JsonSchema(schema, strict=True, limits=LIMITS))
    assert compiled.spec.limits == LIMITS


def test_a_backend_without_the_limits_declares_them(tok):
    from spec_grammar_xgrammar import XGrammarBackend

    class Plain(XGrammarBackend):  # an adapter that does not read spec.limits
        name = "plain"
        output_limits = frozenset()

    b = Plain(tok)
    flexible = b.compile(JsonSchema(SCHEMA, whitespace="flexible", limits=LIMITS))
    said = {w.split(" ", 1)[0] for w in flexible.warnings}
    assert {"max_digits", "max_whitespace"} <= said
    # spaced JSON has no whitespace runs: nothing to declare for them
    spaced = b.compile(JsonSchema(SCHEMA, limits=LIMITS))
    assert "max_whitespace" not in {w.split(" ", 1)[0] for w in spaced.warnings}
    with pytest.raises(UnsupportedGrammarError):  # strict still refuses the user's keywords
        b.compile(JsonSchema({"type": "array", "uniqueItems": True}, strict=True, limits=LIMITS))


def test_closed_objects(backend, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = JsonSchema(schema, limits=OutputLimits(closed_objects=True))
    m = _after(backend, tok, closed, '{"a": 1')
    assert _takes(m, tok, "}") and not _takes(m, tok, ",")
    if backend.name != "outlines":  # outlines writes declared properties only, always
        assert _takes(_after(backend, tok, JsonSchema(schema), '{"a": 1'), tok, ",")


@pytest.mark.integration  # every real schema of the data set
def test_default_limits_compile_on_real_schemas(backend):
    """Every backend compiles real schemas and tool lists under the defaults (llguidance 1.9
    refused multipleOf 1e-12: its fraction bound stops at 10 digits, declared)."""
    from spec_grammar import datasets
    from spec_grammar.json_schema.limits import DEFAULT_OUTPUT_LIMITS

    specs = [
        JsonSchema(r["schema"], limits=DEFAULT_OUTPUT_LIMITS)
        for r in datasets.jsonschemabench_sample("Glaiveai2K")[:3]
    ]
    specs += [
        ToolCalls(c["tools"], limits=DEFAULT_OUTPUT_LIMITS) for c in datasets.bfcl_cases()[:3]
    ]
    for spec in specs:
        compiled = backend.compile(spec)
        if backend.name == "llguidance" and DEFAULT_OUTPUT_LIMITS.max_digits > 10:
            number = '"number"' in json.dumps(spec.model_dump())
            assert not number or any(w.startswith("max_digits:refuses") for w in compiled.warnings)
