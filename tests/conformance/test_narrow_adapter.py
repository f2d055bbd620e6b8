"""A narrow adapter (``examples/literal_adapter``: regexes that are alternations of literal
strings) passes conformance on what it declares, and the suite still catches its bugs.

Oracles: ``re.fullmatch`` for the case documents (inside the suite), fresh-matcher replay for
the random properties, and a copy of the adapter with one bug each, which must fail the named
property (a suite that skips everything would pass the good adapter too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "literal_adapter"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from spec_grammar_literals import LiteralsBackend, LiteralsMatcher, literals_of  # noqa: E402

from spec_grammar.backend_info import _class_body, _literal_assignments  # noqa: E402
from spec_grammar.capabilities import Capabilities  # noqa: E402
from spec_grammar.errors import UnsupportedGrammarError  # noqa: E402
from spec_grammar.specs import Regex  # noqa: E402
from spec_grammar.testing import run_conformance  # noqa: E402
from spec_grammar.testing.fixtures import toy_tokenizer  # noqa: E402


def test_literals_of_reads_alternations_and_refuses_the_rest():
    assert literals_of(r"yes|no|C\+\+|") == ["yes", "no", "C++", ""]
    assert literals_of(r"(?:red|light\ blue)") == ["red", "light blue"]
    for pattern in (r"[a-z]+", r"a*", r"\d", r"(a)|(b)", r"a.b"):
        with pytest.raises(UnsupportedGrammarError, match="literal"):
            literals_of(pattern)


def test_general_regexes_are_refused_not_weakened():
    backend = LiteralsBackend(toy_tokenizer(), vocab_size=32)
    with pytest.raises(UnsupportedGrammarError, match="not a literal"):
        backend.compile(Regex(r'\{"a":[12]+\}'))


@pytest.mark.parametrize("fixture", ["toy", "smollm2"])
def test_narrow_adapter_passes_what_it_declares(fixture):
    results = run_conformance(LiteralsBackend, fixtures=[fixture])
    by_status = {r.name: r.status for r in results}
    assert not [r for r in results if r.status in ("FAIL", "ERROR")], [
        r.detail for r in results if r.status in ("FAIL", "ERROR")
    ]
    # its own cases ran: the random properties and the documents, none of them skipped
    for name in (
        "random_tree_rows",
        "random_rollback_fork",
        "random_split_validate",
        "case_documents",
    ):
        assert by_status[f"{fixture}_{name}"] == "PASS", by_status
    # the suite's general regexes (grammar G, U, the real-schema regex) did not
    skipped = [r for r in results if r.status == "SKIP" and "regex" in r.detail]
    assert skipped and all("not applicable" in r.detail for r in skipped)


class _EosAnywhere(LiteralsMatcher):
    """Bug: EOS allowed (and accepted) after any prefix, not only after a whole literal."""

    def _accept_token(self, token):
        if self.is_stop_token(token):
            self._history = (None, self._history)
            return True
        return super()._accept_token(token)

    def _fill_next_token_bitmask(self, bitmask, row):
        super()._fill_next_token_bitmask(bitmask, row)
        for t in self.info.stop_token_ids:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def _fork(self):
        return _EosAnywhere(self._g, self.info, self._max_rollback_tokens, self._history)


class _EosAnywhereBackend(LiteralsBackend):
    def _matcher(self, compiled):
        return _EosAnywhere(
            compiled.native, self.tokenizer_info, self.max_rollback_tokens, (b"", None)
        )


def test_the_suite_catches_a_narrow_adapters_bug():
    results = run_conformance(_EosAnywhereBackend, fixtures=["toy"], names=["toy_case_documents"])
    assert [r.status for r in results] == ["FAIL"]
    assert "EOS allowed exactly where the document can end" in results[0].detail


def test_subsets_name_claimed_kinds_only():
    with pytest.raises(ValueError, match="not a claimed grammar kind"):
        Capabilities(ebnf=False, subsets={"ebnf": "x"})
    caps = LiteralsBackend.capabilities
    assert caps.describe() == ["regex (alternations of literal strings)"]
    assert not caps.whole("regex") and not caps.whole("json_schema")


def test_the_declaration_reads_without_importing():
    """``spec-grammar backends`` reads the capabilities from the source: the same value."""
    body = _class_body("spec_grammar_literals", "LiteralsBackend")
    declared = Capabilities(**_literal_assignments(body)["capabilities"])
    assert declared == LiteralsBackend.capabilities
