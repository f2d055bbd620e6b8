"""Bad input at the grammar layer, on every backend: each mistake gets a typed error
(:mod:`spec_grammar.errors`) whose message names the problem, and it affects that call only
(the backend and the other matchers keep working, the failing matcher keeps its state).

Real backends on the SmolLM2 tokenizer with 64 padding columns (so ids in
``[len(tokenizer), V)`` exist).
"""

from __future__ import annotations

import re
import threading
import time
from functools import cache

import pytest
import torch

from spec_grammar import get_backend
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import (
    BackendNotFoundError,
    BitmaskError,
    GrammarCompileError,
    GrammarSpecError,
    GrammarStateError,
    InvalidTokenError,
    SpecGrammarError,
    UnsupportedGrammarError,
)
from spec_grammar.registry import load_backend_class
from spec_grammar.specs import Ebnf, JsonSchema, Lark, Regex
from spec_grammar.testing.fixtures import fixture_tokenizer as _fixture_tokenizer
from spec_grammar.tree import DraftTree

BACKENDS = ("xgrammar", "llguidance", "outlines")


@cache
def fixture_tokenizer(name: str):
    return _fixture_tokenizer(name)  # load_tokenizer re-reads the files on every call


@cache
def backend(name: str, **options):
    tok, width = fixture_tokenizer("smollm2")
    return get_backend(name, tok, vocab_size=width, **options)


def ids(text: str) -> list[int]:
    return fixture_tokenizer("smollm2")[0].encode(text, add_special_tokens=False)


EOS = 2  # SmolLM2's <|im_end|>


def test_bad_spec_values_are_named():
    """Spec construction (pydantic): a ValueError naming the problem, before any backend."""
    with pytest.raises(GrammarSpecError, match="schema is not valid JSON: Expecting value"):
        JsonSchema('{"type": ')
    with pytest.raises(GrammarSpecError, match="schema is not valid JSON"):
        JsonSchema("")
    with pytest.raises(GrammarSpecError, match="must be an object or a boolean, got list"):
        JsonSchema([1, 2])
    # a null schema (SGLang's dispatch_json("null")) is named, not "Field required"
    for null in (None, "null"):
        with pytest.raises(GrammarSpecError, match="must be an object or a boolean, got null"):
            JsonSchema(null)


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_schemas(name):
    b = backend(name)
    with pytest.raises(
        GrammarCompileError,
        match=rf"^\[{name}\] invalid JSON Schema at properties/a/type: 'strnig' is not valid",
    ):
        b.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "strnig"}}}))
    with pytest.raises(
        GrammarCompileError,
        match=rf"^\[{name}\] invalid JSON Schema at minItems: -1 is less than the minimum of 0",
    ):
        b.compile(JsonSchema({"type": "array", "minItems": -1}))
    with pytest.raises(
        GrammarCompileError, match=rf"^\[{name}\] the schema `false` accepts no document"
    ):
        b.compile(JsonSchema(False))
    # the empty schema is valid: any JSON document. outlines-core's regex for it (13.9 KB) does
    # not become an Index within a minute: there it ends with the compile-timeout error.
    if name != "outlines":
        m = b.matcher(b.compile(JsonSchema({})))
        doc = ids('{"a": [1, "x"]}') + [EOS]
        assert m.accept_tokens(doc) == len(doc) and m.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_regex_is_named(name):
    b = backend(name)
    for pattern in ("(unclosed", "a{3,1}", "[z-a]"):
        with pytest.raises(
            GrammarCompileError, match=rf"^\[{name}\] regex failed to compile: "
        ) as err:
            b.compile(Regex(pattern))
        assert not isinstance(err.value, UnsupportedGrammarError)
        assert err.value.reason


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_cfg_is_named(name):
    b = backend(name)
    bad = [
        (Ebnf('root ::= "a" undefined_rule\n'), "undefined_rule"),
        (Ebnf('root ::= ("a"\n'), ")"),
        (Lark("start: foo\n"), "foo"),
    ]
    for spec, named in bad:
        if not getattr(b.capabilities, spec.kind):
            with pytest.raises(
                UnsupportedGrammarError,
                match=rf"^\[{name}\] {spec.kind} grammars are not supported$",
            ):
                b.compile(spec)
            continue
        with pytest.raises(GrammarCompileError) as err:
            b.compile(spec)
        assert str(err.value).startswith(f"[{name}] ") and named in str(err.value)


@pytest.mark.parametrize("name", BACKENDS)
def test_size_limit_and_unknown_backend(name):
    tok, width = fixture_tokenizer("smollm2")
    small = get_backend(name, tok, vocab_size=width, max_grammar_bytes=10_000)
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(1000)}}
    with pytest.raises(
        GrammarCompileError,
        match=rf"^\[{name}\] the json_schema spec is \d+ bytes, over max_grammar_bytes=10000$",
    ):
        small.compile(JsonSchema(huge))
    assert small.num_compiles == 0
    with pytest.raises(
        BackendNotFoundError, match=r"unknown grammar backend 'xgramar'; registered: .*xgrammar"
    ):
        get_backend("xgramar", tok)
    with pytest.raises(BackendNotFoundError, match=r"cannot load backend class 'nosuch\.module:X'"):
        load_backend_class("nosuch.module:X")


@pytest.mark.parametrize("name", BACKENDS)
def test_library_older_than_the_adapter_needs_is_refused(name, monkeypatch):
    """An engine's pin can leave an older library in place (SGLang 0.5.23 pins xgrammar 0.2.7,
    whose GrammarCompiler lacks an argument ours passes: a TypeError when the engine built the
    backend): loading the backend says what it needs and what it found."""
    cls = load_backend_class(name)  # the installed release is new enough
    library = cls.library_requirement.partition(">=")[0]
    monkeypatch.setattr(cls, "library_version", classmethod(lambda c: "0.0.1"))
    with pytest.raises(
        BackendNotFoundError,
        match=rf"^backend '{name}' needs {re.escape(cls.library_requirement)}, "
        rf"found {re.escape(library)} 0\.0\.1; install it with: pip install",
    ):
        get_backend(name, fixture_tokenizer("smollm2")[0])


class _Blocked:
    """Makes a backend's compile wait on an event: a compile that never finishes (until the
    test releases it, so no thread is left running)."""

    def __init__(self, name: str):
        base = load_backend_class(name)
        self.release = threading.Event()
        release = self.release

        class Blocking(base):  # a real backend subclass: only _compile is slowed down
            def _compile(self, spec):
                release.wait(30)
                return super()._compile(spec)

        tok, width = fixture_tokenizer("smollm2")
        self.backend = Blocking(tok, vocab_size=width, compile_timeout_s=0.3)


@pytest.mark.parametrize("name", BACKENDS)
def test_compile_timeout_is_per_spec(name):
    blocked = _Blocked(name)
    try:
        t0 = time.perf_counter()
        with pytest.raises(
            GrammarCompileError,
            match=rf"^\[{name}\] regex compile did not finish within compile_timeout_s=0.3$",
        ):
            blocked.backend.compile(Regex("ab+"))
        assert time.perf_counter() - t0 < 3.0
        # cached as failed: a retry does not start a second stuck compile
        with pytest.raises(GrammarCompileError, match="did not finish"):
            blocked.backend.compile(Regex("ab+"))
        assert blocked.backend.num_compiles == 1
    finally:
        blocked.release.set()
    # the backend still compiles after a timeout (a looser limit: 0.3 s is one loaded moment)
    blocked.backend.compile_timeout_s = 30.0
    m = blocked.backend.matcher(blocked.backend.compile(Regex("cd")))
    assert m.accept_tokens(ids("cd") + [EOS]) == len(ids("cd")) + 1


@pytest.mark.parametrize("name", BACKENDS)
def test_out_of_range_tokens(name):
    b = backend(name)
    V, n_tok = b.vocab_size, b.tokenizer_info.tokenizer_vocab_size
    assert V > n_tok  # padding columns exist
    m = b.matcher(b.compile(Regex("ab+c")))
    a = ids("a")
    assert m.accept_tokens(a) == 1
    for bad in (-1, V, V + 1000, -(2**40)):
        with pytest.raises(
            InvalidTokenError, match=rf"^token id {bad} is outside the logits width \[0, {V}\)$"
        ):
            m.accept_token(bad)
        with pytest.raises(InvalidTokenError, match="outside the logits width"):
            m.accept_tokens(ids("b") + [bad])
        assert m.validate_tokens(ids("b") + [bad]) == 1
        assert not m.is_stop_token(bad)
    assert (
        m.accept_token(n_tok) is False and m.accept_token(V - 1) is False
    )  # padding: refused, no error
    assert m.num_accepted == 1  # nothing of the failed calls was consumed
    bm = allocate_token_bitmask(5, V)
    b_tok = ids("b")[0]
    tree = DraftTree([a[0], -1, V + 3, n_tok, b_tok], [-1, 0, 0, 0, 0])
    valid = m.fill_tree_bitmask(tree, bm)
    assert valid.tolist() == [True, False, False, False, True]
    assert not bm[1:4].any()
    assert m.num_accepted == 1 and m.accept_tokens(ids("bc") + [EOS]) == len(ids("bc")) + 1


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_bounds(name):
    b = backend(name, max_rollback_tokens=3)
    m = b.matcher(b.compile(Regex("a+")))
    a = ids("a")[0]
    assert m.accept_tokens([a] * 5) == 5
    with pytest.raises(GrammarStateError, match=r"^rollback\(4\) exceeds max_rollback_tokens=3$"):
        m.rollback(4)
    with pytest.raises(GrammarStateError, match=r"^rollback\(-1\): the count must be >= 0$"):
        m.rollback(-1)
    m.rollback(3)
    assert m.num_accepted == 2
    fresh = b.matcher(b.compile(Regex("a+")))
    with pytest.raises(
        GrammarStateError, match=r"^rollback\(1\) exceeds the 0 tokens accepted so far$"
    ):
        fresh.rollback(1)
    assert fresh.accept_token(a)


@pytest.mark.parametrize("name", BACKENDS)
def test_terminated_matcher(name):
    b = backend(name)
    m = b.matcher(b.compile(Regex("ab")))
    doc = ids("ab") + [EOS]
    assert m.accept_tokens(doc) == len(doc) and m.is_terminated()
    bm = allocate_token_bitmask(2, b.vocab_size)
    with pytest.raises(
        GrammarStateError, match="^fill_next_token_bitmask on a terminated matcher$"
    ):
        m.fill_next_token_bitmask(bm, 0)
    with pytest.raises(GrammarStateError, match="^fill_tree_bitmask on a terminated matcher$"):
        m.fill_tree_bitmask(DraftTree([EOS, 5], [-1, 0]), bm)
    with pytest.raises(GrammarStateError, match="terminated matcher"):
        b.fill_tree_bitmasks([(m, DraftTree([EOS], [-1]), 0)], bm)
    assert m.accept_token(ids("a")[0]) is False
    assert m.accept_token(EOS) is False
    assert m.accept_tokens(ids("ab")) == 0 and m.validate_tokens(ids("ab")) == 0
    assert m.forced_tokens() == []
    with pytest.raises(InvalidTokenError):
        m.accept_token(-1)  # range is checked first, terminated or not
    child = m.fork()
    assert child.is_terminated() and child.num_accepted == m.num_accepted
    m.rollback(1)  # undo across termination
    assert not m.is_terminated() and child.is_terminated()
    m.fill_next_token_bitmask(bm, 0)
    assert bm[0].any()


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_bitmasks(name):
    b = backend(name)
    V = b.vocab_size
    W = (V + 31) // 32
    m = b.matcher(b.compile(Regex("ab")))
    tree = DraftTree([ids("x")[0], ids("a")[0]], [-1, 0])  # root: the last committed token
    good = allocate_token_bitmask(4, V)
    before = good.clone()
    bad = [
        (
            torch.zeros(2, W, dtype=torch.int64),
            "bitmask dtype must be torch.int32, got torch.int64",
        ),
        (
            torch.zeros(2, W, dtype=torch.uint8),
            "bitmask dtype must be torch.int32, got torch.uint8",
        ),
        (torch.zeros(W, dtype=torch.int32), r"bitmask must be 2-D \(rows, words\), got shape"),
        (torch.zeros(2, W + 1, dtype=torch.int32), "words"),
        (torch.zeros(2, W - 1, dtype=torch.int32), "words"),
        (torch.zeros(W, 4, dtype=torch.int32).t(), "contiguous|words"),
        (torch.zeros(2, 2 * W, dtype=torch.int32)[:, ::2], "contiguous"),
        ([[0] * W], "must be a torch.Tensor, got list"),
    ]
    for bm, msg in bad:
        with pytest.raises(BitmaskError, match=msg):
            m.fill_next_token_bitmask(bm, 0)
        with pytest.raises(BitmaskError, match=msg):
            m.fill_tree_bitmask(tree, bm, 0)
        with pytest.raises(BitmaskError, match=msg):
            b.fill_tree_bitmasks([(m, tree, 0)], bm)
    for row in (4, -5):
        with pytest.raises(
            BitmaskError, match=f"row {row} is out of range for a bitmask with 4 rows"
        ):
            m.fill_next_token_bitmask(good, row)
    for off in (3, -1):
        with pytest.raises(
            BitmaskError, match=rf"rows \[{off}, {off + 2}\) do not fit a bitmask with 4 rows"
        ):
            m.fill_tree_bitmask(tree, good, off)
    assert torch.equal(good, before)  # nothing written by the refused calls
    assert m.num_accepted == 0 and m.fill_tree_bitmask(tree, good, 2).tolist() == [True, True]


@pytest.mark.parametrize("name", BACKENDS)
def test_errors_do_not_leak_into_other_requests(name):
    """A refused spec, a refused call and a typed error on one matcher leave another matcher
    (same compiled grammar) and the backend's cache exactly as they were."""
    b = backend(name)
    compiled = b.compile(Regex("ab+c"))
    m1, m2 = b.matcher(compiled), b.matcher(compiled)
    assert m1.accept_tokens(ids("ab")) == len(ids("ab"))
    for call in (
        lambda: b.compile(Regex("(unclosed")),
        lambda: b.compile(JsonSchema({"type": "nope"})),
        lambda: m2.accept_token(-1),
        lambda: m2.rollback(5),
        lambda: m2.fill_next_token_bitmask(torch.zeros(1, 3, dtype=torch.int32), 0),
    ):
        with pytest.raises(SpecGrammarError):
            call()
    assert b.compile(Regex("ab+c")) is compiled
    rest = ids("bc") + [EOS]
    assert m1.accept_tokens(rest) == len(rest) and m1.is_terminated()
    doc = ids("abbc") + [EOS]
    assert m2.accept_tokens(doc) == len(doc) and m2.is_terminated()
