"""Third-party adapters that implement the protocol's hooks wrongly: named at the first door
they pass (the registry, ``matcher()``, ``fork()``, ``accept_tokens()``), not taken as working
and not failing later with an unrelated error."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

from spec_grammar import Regex
from spec_grammar.cli import main
from spec_grammar.errors import BackendNotFoundError, GrammarStateError
from spec_grammar.protocol import GrammarBackend, SpecGrammar, TokenizerInfo
from spec_grammar.registry import load_backend_class
from spec_grammar.worker import api

INFO = TokenizerInfo(None, vocab_size=8, tokenizer_vocab_size=8, stop_token_ids=(0,))


class AnyToken(SpecGrammar):
    """Accepts every token; its hooks' results can be swapped per test."""

    accept_tokens_result = None
    fork_result = None

    def _accept_token(self, token):
        return True

    def _accept_tokens(self, tokens):
        if self.accept_tokens_result is not None:
            return self.accept_tokens_result
        return len(tokens)

    def _rollback(self, num_tokens):
        pass

    def _fork(self):
        return AnyToken(self.info) if self.fork_result is None else self.fork_result(self)

    def _fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def _is_terminated(self):
        return False


class AnyBackend(GrammarBackend):
    name = "any"
    matcher_result = None

    def _compile(self, spec):
        return spec

    def _matcher(self, compiled):
        return AnyToken(self.info_) if self.matcher_result is None else self.matcher_result

    @property
    def info_(self):
        return self.tokenizer_info


@pytest.fixture
def adapters(tmp_path, monkeypatch):
    """A module ``half_adapters`` on sys.path with adapters broken in one way each."""
    (tmp_path / "half_adapters.py").write_text(
        textwrap.dedent(
            """
            from spec_grammar.protocol import GrammarBackend

            class NoMatcher(GrammarBackend):
                name = "no-matcher"

                def _compile(self, spec):
                    return spec

            class DictCapabilities(NoMatcher):
                capabilities = {"regex": True, "json_schema": True}

                def _matcher(self, compiled):
                    raise AssertionError("never reached")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "half_adapters", raising=False)


def test_an_adapter_missing_a_hook_is_refused_by_the_registry(adapters):
    """``load_backend_class`` took it, ``spec-grammar backends`` listed it as fine, and building
    it failed later with a TypeError."""
    with pytest.raises(BackendNotFoundError, match="NoMatcher does not implement the hook"):
        load_backend_class("half_adapters:NoMatcher")


def test_capabilities_of_the_wrong_type_are_refused_by_the_registry(adapters):
    """A dict made every ``compile`` an ``UnsupportedGrammarError``: "regex grammars are not
    supported" from an adapter that claims regex."""
    with pytest.raises(BackendNotFoundError, match="capabilities must be a Capabilities, got dict"):
        load_backend_class("half_adapters:DictCapabilities")


def test_cli_with_an_adapter_missing_a_hook_is_one_line_before_the_model(
    adapters, capsys, monkeypatch
):
    """Was a TypeError traceback: from the early compile with ``--regex``, after the model had
    loaded without a grammar flag."""
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    for grammar in (["--regex", "a+"], []):
        rc = main(["generate", "--backend", "half_adapters:NoMatcher", *grammar, "hi"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith("spec-grammar generate: error: ") and "_matcher" in err


@pytest.mark.parametrize("wrong", [np.int64(3), object(), "matcher"])
def test_a_matcher_hook_returning_no_spec_grammar_is_named(wrong):
    """A library matcher returned as is would skip every check of the protocol."""
    backend = AnyBackend(INFO)
    backend.matcher_result = wrong
    with pytest.raises(GrammarStateError, match=r"AnyBackend\._matcher must return a SpecGrammar"):
        backend.matcher(backend.compile(Regex("a")))


@pytest.mark.parametrize(
    "fork, says",
    [(lambda self: self, "the matcher itself"), (lambda self: None, "NoneType")],
)
def test_a_fork_hook_returning_no_new_matcher_is_named(fork, says):
    m = AnyToken(INFO)
    m.fork_result = fork
    with pytest.raises(
        GrammarStateError, match=rf"AnyToken\._fork must return a new SpecGrammar.*{says}"
    ):
        m.fork()
    m.fork_result = None
    assert isinstance(m.fork(), AnyToken)


@pytest.mark.parametrize("wrong", [5, -1, True, 1.0, "two"])
def test_an_accept_tokens_hook_returning_a_bad_count_is_named(wrong):
    """A count past the tokens given, or not a count, went into ``num_accepted`` and with it the
    rollback bound."""
    m = AnyToken(INFO)
    m.accept_tokens_result = wrong
    with pytest.raises(
        GrammarStateError, match=r"AnyToken\._accept_tokens returned .* for 2 tokens"
    ):
        m.accept_tokens([1, 2])
    assert m.num_accepted == 0


def test_an_accept_tokens_hook_may_return_a_numpy_count():
    m = AnyToken(INFO)
    m.accept_tokens_result = np.int64(2)
    assert m.accept_tokens([1, 2]) == 2 and m.num_accepted == 2


def test_tool_calls_need_json_schema_support():
    """``tool_calls`` defaults to True: an adapter declaring only ``json_schema=False`` had its
    ``_compile`` handed the tool calls' JSON schema, a kind it never claimed."""
    from spec_grammar import ToolCalls, UnsupportedGrammarError
    from spec_grammar.protocol import Capabilities

    class RegexOnly(AnyBackend):
        capabilities = Capabilities(json_schema=False, regex=True)

        def _compile(self, spec):
            assert isinstance(spec, Regex), f"handed a {spec.kind}"
            return spec

    backend = RegexOnly(INFO)
    assert backend.capabilities.tool_calls  # the default, as an older adapter leaves it
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(UnsupportedGrammarError, match="tool_calls grammars are not supported"):
        backend.compile(ToolCalls(tools))
    assert backend.compile(Regex("a")).native == Regex("a")


@pytest.mark.parametrize(
    "valid",
    [
        lambda n: [True] * n,
        lambda n: torch.ones(n, dtype=torch.int32),
        lambda n: torch.ones(n + 1, dtype=torch.bool),
        lambda n: None,
    ],
)
def test_a_tree_fill_hook_returning_no_valid_mask_is_named(valid):
    """The worker reads ``valid`` as an ``(N,)`` bool tensor: a list or an int tensor failed
    (or read wrong) in the middle of a step."""
    from spec_grammar import allocate_token_bitmask
    from spec_grammar.tree import DraftTree

    class OddTreeFill(AnyToken):
        def _fill_tree_bitmask(self, tree, bitmask, row_offset):
            super()._fill_tree_bitmask(tree, bitmask, row_offset)
            return valid(tree.num_nodes)

    tree = DraftTree([1, 2, 3], [-1, 0, 0])
    bitmask = allocate_token_bitmask(3, INFO.vocab_size)
    with pytest.raises(
        GrammarStateError, match=r"OddTreeFill\._fill_tree_bitmask must return a \(3,\) bool"
    ):
        OddTreeFill(INFO).fill_tree_bitmask(tree, bitmask)
    assert AnyToken(INFO).fill_tree_bitmask(tree, bitmask).tolist() == [True, True, True]
