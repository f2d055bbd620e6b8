"""Core protocol machinery shared by every backend: compile cache, registry, specs, checks."""

import json
import threading

import pytest
from pydantic import BaseModel

from spec_grammar import (
    BackendNotFoundError,
    GrammarCompileError,
    GrammarStateError,
    InvalidTokenError,
    JsonSchema,
    Regex,
    ToolCalls,
    UnsupportedGrammarError,
    allocate_token_bitmask,
    get_backend,
    list_backends,
)
from spec_grammar.errors import GrammarSpecError


@pytest.fixture(scope="module")
def xgr(tok):
    return get_backend("xgrammar", tok)


def test_specs_normalize():
    class Person(BaseModel):
        name: str
        age: int

    from_model = JsonSchema(Person)
    assert from_model.json_schema["required"] == ["name", "age"]
    assert JsonSchema(json.dumps({"type": "string"})).json_schema == {"type": "string"}
    with pytest.raises(GrammarSpecError, match="not valid JSON"):
        JsonSchema("{not json")
    with pytest.raises(GrammarSpecError, match="object or a boolean"):
        JsonSchema("[1, 2]")
    with pytest.raises(GrammarSpecError, match="at least one tool"):
        ToolCalls([])
    with pytest.raises(GrammarSpecError, match="no function name"):
        ToolCalls([{"type": "function", "function": {}}])
    # key order is part of the grammar
    a = JsonSchema({"properties": {"a": {}, "b": {}}})
    b = JsonSchema({"properties": {"b": {}, "a": {}}})
    assert a.cache_key() != b.cache_key()


def test_tool_calls_schema_validates_example():
    import jsonschema

    from spec_grammar.datasets import bfcl_cases

    for case in bfcl_cases()[:10]:
        schema = ToolCalls(case["tools"]).to_json_schema().json_schema
        jsonschema.Draft202012Validator.check_schema(schema)
        if case["example_output_valid"]:
            jsonschema.validate(case["example_output"], schema)


def test_concurrent_compiles_run_once(tok):
    backend = get_backend("xgrammar", tok)
    specs = [
        JsonSchema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        for i in range(3)
    ]
    results = {}
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        results[i] = [backend.compile(s) for s in specs]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.num_compiles == 3
    for i in range(8):
        for j in range(3):
            assert results[i][j] is results[0][j]


def test_compile_cache_evicts(tok):
    backend = get_backend("xgrammar", tok, compile_cache_size=2)
    for i in range(4):
        backend.compile(Regex(f"a{{{i + 1}}}"))
    assert len(backend._cache) == 2
    backend.compile(Regex("a{1}"))  # evicted: compiled again
    assert backend.num_compiles == 5


def test_compile_errors_are_typed_and_cached(xgr):
    before = xgr.num_compiles
    for _ in range(2):
        with pytest.raises(GrammarCompileError, match=r"\[xgrammar\]"):
            xgr.compile(Regex("(unclosed"))
    assert xgr.num_compiles == before + 1


def test_registry_errors(tok):
    with pytest.raises(BackendNotFoundError, match="unknown grammar backend 'nope'.*xgrammar"):
        get_backend("nope", tok)
    with pytest.raises(BackendNotFoundError, match="cannot load"):
        get_backend("no_such_module:Backend", tok)
    with pytest.raises(BackendNotFoundError, match="GrammarBackend subclass"):
        get_backend("json:dumps", tok)
    names = {b.name for b in list_backends()}
    assert {"xgrammar", "llguidance", "outlines"} <= names


def test_protocol_guards(xgr, tok):
    m = xgr.matcher(xgr.compile(Regex("ab")))
    with pytest.raises(InvalidTokenError, match="outside the logits width"):
        m.accept_token(-1)
    with pytest.raises(InvalidTokenError):
        m.accept_tokens([tok.encode("a")[0], len(tok)])
    assert m.num_accepted == 0
    assert m.validate_tokens([-1]) == 0
    with pytest.raises(GrammarStateError, match="exceeds the 0 tokens"):
        m.rollback(1)
    with pytest.raises(GrammarStateError, match=">= 0"):
        m.rollback(-1)
    ids = tok.encode("ab")
    assert m.accept_tokens(ids) == len(ids)
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    bm = allocate_token_bitmask(1, xgr.vocab_size)
    with pytest.raises(GrammarStateError, match="terminated"):
        m.fill_next_token_bitmask(bm, 0)
    assert m.accept_token(ids[0]) is False and m.forced_tokens() == []
    m.rollback(1)
    assert not m.is_terminated()
    other = get_backend("xgrammar", tok)
    with pytest.raises(GrammarStateError, match="not compiled by this backend"):
        other.matcher(xgr.compile(Regex("ab")))
    small = get_backend("xgrammar", tok, max_rollback_tokens=2)
    m2 = small.matcher(small.compile(Regex("a+")))
    a = tok.encode("a")[0]
    assert m2.accept_tokens([a, a, a]) == 3
    with pytest.raises(GrammarStateError, match="max_rollback_tokens=2"):
        m2.rollback(3)


def test_unsupported_kind_is_typed(tok):
    from spec_grammar_xgrammar import XGrammarBackend

    from spec_grammar.protocol import Capabilities

    class RegexOnly(XGrammarBackend):
        capabilities = Capabilities(json_schema=False, regex=True, tool_calls=False)

    b = RegexOnly(tok)
    with pytest.raises(UnsupportedGrammarError, match="json_schema grammars are not supported"):
        b.compile(JsonSchema({"type": "object"}))


def test_padding_columns_never_allowed(tok):
    wide = get_backend("xgrammar", tok, vocab_size=len(tok) + 100)
    m = wide.matcher(wide.compile(JsonSchema({"type": "object"})))
    bm = allocate_token_bitmask(1, wide.vocab_size)
    m.fill_next_token_bitmask(bm, 0)
    from spec_grammar import unpack_bitmask

    assert not unpack_bitmask(bm, wide.vocab_size)[0, len(tok) :].any()
    assert m.accept_token(len(tok) + 5) is False
    # a run holding a padding id stops there: the adapter's hook never sees the id
    seen, hook = [], m._accept_tokens
    m._accept_tokens = lambda ts: seen.extend(ts) or hook(ts)
    brace = tok.encode("{", add_special_tokens=False)
    assert m.accept_tokens(brace + [len(tok) + 5] + brace) == len(brace) == m.num_accepted
    assert seen == brace


def test_invalid_schema_named(xgr):
    with pytest.raises(GrammarCompileError, match=r"invalid JSON Schema at properties/a/type"):
        xgr.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "strnig"}}}))
    with pytest.raises(GrammarCompileError, match=r"invalid JSON Schema at minLength"):
        xgr.compile(JsonSchema({"type": "string", "minLength": -1}))


def test_compile_limits(tok):
    import time

    from spec_grammar_xgrammar import XGrammarBackend

    class Slow(XGrammarBackend):
        def _compile(self, spec):
            time.sleep(2.0)
            return super()._compile(spec)

    slow = Slow(tok, compile_timeout_s=0.2)
    t0 = time.perf_counter()
    with pytest.raises(GrammarCompileError, match="did not finish within compile_timeout_s=0.2"):
        slow.compile(Regex("a"))
    assert time.perf_counter() - t0 < 1.5
    small = get_backend("xgrammar", tok, max_grammar_bytes=200)
    with pytest.raises(GrammarCompileError, match="over max_grammar_bytes=200"):
        small.compile(JsonSchema({"enum": ["x" * 300]}))


def test_missing_hook_refused_at_construction():
    """Required hooks are abstract: a class lacking one fails when built, naming the hook, not
    at the hook's first call."""
    from spec_grammar.protocol import GrammarBackend, SpecGrammar, TokenizerInfo

    info = TokenizerInfo(None, vocab_size=8, tokenizer_vocab_size=8, stop_token_ids=(0,))

    class NoMatcher(GrammarBackend):
        def _compile(self, spec):
            return spec

    with pytest.raises(TypeError, match="NoMatcher.*_matcher"):
        NoMatcher(info)

    hooks = ("_accept_token", "_rollback", "_fork", "_fill_next_token_bitmask", "_is_terminated")
    for missing in hooks:
        body = {h: (lambda self, *args: None) for h in hooks if h != missing}
        cls = type(f"No{missing.title().replace('_', '')}", (SpecGrammar,), body)
        with pytest.raises(TypeError, match=missing):
            cls(info)
    complete = type("Complete", (SpecGrammar,), {h: (lambda self, *args: None) for h in hooks})
    assert complete(info).num_accepted == 0
    # a _fork that returns no matcher is named at fork(), not deep inside the bookkeeping
    with pytest.raises(
        GrammarStateError, match="Complete._fork must return a new SpecGrammar, got NoneType"
    ):
        complete(info).fork()


def test_capabilities_are_grammar_kinds_and_tolerate_removed_flags():
    """Every flag is read by compile; an adapter written for earlier versions that still passes
    the removed fast-path flags loads, and the flags are dropped."""
    from spec_grammar.protocol import Capabilities

    assert set(Capabilities.model_fields) - {"subsets"} == {
        "json_schema",
        "regex",
        "ebnf",
        "lark",
        "tool_calls",
    }
    old_style = Capabilities(
        json_schema=False,
        regex=True,
        native_rollback=True,
        native_fork=True,
        native_validate=False,
        native_tree_fill=False,
        native_forced_tokens=True,
        parallel_fill=True,
        releases_gil=True,
    )
    assert old_style.model_dump(exclude={"subsets"}) == {
        "json_schema": False,
        "regex": True,
        "ebnf": False,
        "lark": False,
        "tool_calls": True,
    }
    assert not hasattr(old_style, "native_rollback")


def test_tokenizer_info_from_plain_tokenizers_tokenizer(tok):
    """``TokenizerInfo.from_huggingface`` takes the Rust ``tokenizers.Tokenizer`` behind a
    transformers tokenizer and gives the same info once told the stop tokens (it has no EOS)."""
    from spec_grammar.protocol import TokenizerInfo

    hf = TokenizerInfo.from_huggingface(tok, vocab_size=len(tok) + 7)
    plain = TokenizerInfo.from_huggingface(
        tok.backend_tokenizer,
        vocab_size=len(tok) + 7,
        stop_token_ids=[tok.eos_token_id],
    )
    assert plain.hf_tokenizer is tok.backend_tokenizer
    for field in ("vocab_size", "tokenizer_vocab_size", "stop_token_ids", "special_token_ids"):
        assert getattr(plain, field) == getattr(hf, field), field
    assert plain.token_bytes == hf.token_bytes
    assert plain.decode(tok.encode('{"a": "é"}')) == '{"a": "é"}'
    with pytest.raises(ValueError, match="no eos_token_id; pass stop_token_ids"):
        TokenizerInfo.from_huggingface(tok.backend_tokenizer)
    with pytest.raises(TypeError, match="expected a Hugging Face tokenizer, got dict"):
        TokenizerInfo.from_huggingface({})
