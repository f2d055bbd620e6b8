"""Compile errors of every backend are one line that names the cause: the library's text with
its decoration (log prefixes, caret markers, source excerpts) taken off. The CLI prints them as
its one error line."""

from __future__ import annotations

import pytest

from spec_grammar import Ebnf, GrammarCompileError, JsonSchema, Lark, Regex, get_backend
from spec_grammar.cli import main
from spec_grammar.worker import api

CASES = [
    (Regex("(a"), {"xgrammar": "parenthesis is not closed", "llguidance": "unclosed group"}),
    (
        Regex("[z-a]"),
        {"xgrammar": "lower bound is larger", "llguidance": "start must be <= the end"},
    ),
    (
        Regex("\\p{Foo}"),
        {
            "xgrammar": "escape sequence is not supported",
            "llguidance": "Unicode property not found",
        },
    ),
    (Lark("start: foo"), {"xgrammar": "unknown name 'foo'", "llguidance": 'unknown name: "foo"'}),
    (Lark("x"), {"xgrammar": "expected ':' after rule name", "llguidance": "Expected token ':'"}),
    (Ebnf('root ::= "a" | '), {"xgrammar": "Expect element"}),
    (
        JsonSchema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(b"}}}),
        {"xgrammar": "parenthesis is not closed", "llguidance": "(b error: unclosed group"},
    ),
]


PARAMS = [(name, spec, says) for spec, by_name in CASES for name, says in by_name.items()]


@pytest.mark.parametrize(
    "name, spec, says", PARAMS, ids=[f"{n}-{s.kind}{i}" for i, (n, s, _) in enumerate(PARAMS)]
)
def test_compile_errors_are_one_line_naming_the_cause(tok, name, spec, says):
    """llguidance's regex and Lark errors came with the pattern, caret lines and a numbered
    source excerpt (six lines); xgrammar's Lark errors with the source line and a caret."""
    pytest.importorskip(f"spec_grammar_{name}")
    with pytest.raises(GrammarCompileError) as e:
        get_backend(name, tok).compile(spec)
    message = str(e.value)
    assert "\n" not in message and not any(set(w) == {"^"} for w in message.split()), message
    assert message.startswith(f"[{name}] ") and says in message, message
    assert "\n" not in (e.value.reason or "")


def test_cli_prints_a_llguidance_compile_error_as_one_line(capsys, monkeypatch):
    pytest.importorskip("spec_grammar_llguidance")
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    rc = main(["generate", "--backend", "llguidance", "--regex", "(a", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("spec-grammar generate: error: [llguidance] regex failed to compile")
    assert "unclosed group" in err
