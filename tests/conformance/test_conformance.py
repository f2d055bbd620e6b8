"""The conformance suite itself: it passes on every registered backend, catches every bug of
the deliberately broken adapter (naming the right property), and its runners (CLI, pytest
plugin) report failures with the contract, input and allowed sets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import broken_adapter
import pytest

from spec_grammar.cli import main
from spec_grammar.registry import get_backend, list_backends
from spec_grammar.testing import (
    PROPERTIES,
    Session,
    resolve_factory,
    run_conformance,
    run_property,
    select_properties,
)
from spec_grammar.testing.fixtures import (
    TOY_TOKEN_BYTES,
    TOY_WIDTH,
    fixture_tokenizer,
    toy_tokenizer,
)
from spec_grammar.testing.json_suite import (
    acceptance,
    compare_backends,
    format_table,
    suite_cases,
    unsound_cases,
)
from spec_grammar.vocab import token_bytes_table

# the whole suite over every backend and the real tokenizer, and pytester runs
pytestmark = pytest.mark.integration

SUPPORT = Path(__file__).parents[1] / "support"
AVAILABLE = [b.name for b in list_backends() if b.error is None]
UNAVAILABLE = [b for b in list_backends() if b.error is not None]
ALL_PROPERTIES = [p.name for p in select_properties()]
# Run by test_json_suite_differences below (one acceptance pass for the report and the check).
SUITE_PROPERTIES = [n for n in ALL_PROPERTIES if n != "smollm2_json_suite_sound"]

_sessions: dict[str, Session] = {}


def _session(name: str) -> Session:
    if name not in _sessions:
        _sessions[name] = Session(resolve_factory(name))
    return _sessions[name]


# -- the toy tokenizer is read as intended by every library ---------------------------------
def test_toy_tokenizer_bytes_in_every_library():
    tok = toy_tokenizer()
    assert len(tok) == len(TOY_TOKEN_BYTES) == 20 and tok.eos_token_id == 0
    assert token_bytes_table(tok) == list(TOY_TOKEN_BYTES)
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=TOY_WIDTH, stop_token_ids=[0])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert list(info.decoded_vocab[:20]) == list(TOY_TOKEN_BYTES)
    llg_hf = pytest.importorskip("llguidance.hf")
    lt = llg_hf.from_tokenizer(tok, n_vocab=TOY_WIDTH)
    assert [lt.decode_bytes([i]) for i in range(20)] == list(TOY_TOKEN_BYTES)


# -- every registered backend passes ---------------------------------------------------------
def _conformance_params():
    for backend in AVAILABLE:
        for prop in SUITE_PROPERTIES:
            yield pytest.param(backend, prop, id=f"{backend}-{prop}")


@pytest.mark.parametrize("backend,prop", list(_conformance_params()))
def test_backend_conforms(backend, prop):
    result = run_property(PROPERTIES[prop], _session(backend))
    if result.status == "SKIP":
        pytest.skip(result.detail)
    assert result.status == "PASS", result.detail


def test_unavailable_backends_are_reported():
    # A registered backend whose library or adapter is missing is listed with a reason, not
    # silently dropped (the parametrization above only covers loadable ones).
    for info in UNAVAILABLE:
        assert info.error and info.name in info.error


# -- the broken adapter is caught, bug by bug ------------------------------------------------
CAUGHT_BY = {
    "rollback_keeps_termination": "toy_T1_rollback_fork_roundtrip",
    "fork_shares_state": "toy_fork_independent",
    "tree_expands_invalid": "toy_T3_tree_rows",
    "tree_stale_rows": "toy_T3_tree_rows",
    "refused_partial": "toy_T2_refused_token_noop",
    "padding_allowed": "toy_T10_mask_accept_agree",
    "eos_mid_grammar": "toy_T10_mask_accept_agree",
    "validate_mutates": "toy_T9_split_validate",
    "row_limit": "toy_rows_agree_with_accept",
}


def test_every_bug_has_a_catching_property():
    assert set(CAUGHT_BY) == set(broken_adapter.BUGS)


def test_broken_adapter_without_bugs_passes_toy_suite():
    results = run_conformance(broken_adapter.BrokenBackend, fixtures=["toy"])
    # the case-document property skips: this adapter supplies no cases of its own
    assert all(
        r.status == "PASS" or (r.status == "SKIP" and "case_documents" in r.name) for r in results
    ), [r.detail for r in results if r.status != "PASS"]


@pytest.mark.parametrize("bug", sorted(broken_adapter.BUGS))
def test_suite_catches_bug(bug):
    results = {
        r.name: r for r in run_conformance(broken_adapter.backend_with(bug), fixtures=["toy"])
    }
    failed = {n for n, r in results.items() if r.status in ("FAIL", "ERROR")}
    name = CAUGHT_BY[bug]
    assert name in failed, f"{bug} not caught by {name}; failed: {sorted(failed)}"
    detail = results[name].detail
    assert results[name].status == "FAIL" and detail.startswith("contract: ") and "input:" in detail


@pytest.mark.parametrize(
    "bug,prop",
    [
        ("tree_stale_rows", "smollm2_random_tree_rows"),
        ("validate_mutates", "smollm2_random_split_validate"),
        ("refused_partial", "smollm2_random_rollback_fork"),
    ],
)
def test_random_properties_catch_bug_on_real_tokenizer(bug, prop):
    (result,) = run_conformance(broken_adapter.backend_with(bug), names=[prop])
    assert result.status == "FAIL", result.detail


# -- runners: CLI and pytest plugin ------------------------------------------------------------
def test_cli_passes_on_xgrammar_quick(capsys):
    pytest.importorskip("xgrammar")
    names = [p.name for p in select_properties(["toy"])]
    args = ["conformance", "--backend", "xgrammar", "--quick", "--json"]
    assert main(args + [a for n in names for a in ("--property", n)]) == 0
    report = json.loads(capsys.readouterr().out)
    # the case-document property skips: xgrammar supplies no cases of its own
    assert report["passed"] and all(
        r["status"] == "PASS" or (r["status"] == "SKIP" and "case_documents" in r["name"])
        for r in report["results"]
    )
    assert [r["name"] for r in report["results"]] == names


def test_cli_reports_failure_with_sets_and_text(capsys):
    code = main(["conformance", "--backend", "broken_adapter:FortyTwo", "--quick"])
    assert code == 2  # no such class: a usage error, not a conformance failure
    capsys.readouterr()
    args = [
        "conformance",
        "--backend",
        "broken_adapter:EosMidGrammar",
        "--quick",
        "--property",
        "toy_G_allowed_sets",
    ]
    code = main(args)
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "toy_G_allowed_sets" in out
    assert "contract: mask = grammar's allowed set" in out
    # expected and actual sets as ids with decoded text; EOS shows up as the extra id
    assert "expected: {1 '{', 11 '{\"a\":'}" in out
    assert "extra:    {0 '<eos>'}" in out


def test_pytest_plugin_generates_one_test_per_property(tmp_path):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(tmp_path),
        "--spec-grammar-backend",
        "broken_adapter:ForkSharesState",
        "--spec-grammar-tokenizer",
        "toy",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    m = re.search(r"(\d+) failed, (\d+) passed(?:, (\d+) skipped)?", out)
    total = int(m[1]) + int(m[2]) + int(m[3] or 0) if m else -1
    assert total == len(select_properties(["toy"])), out[-3000:]
    assert (
        "FAILED ::spec-grammar-conformance[broken_adapter:ForkSharesState]::toy_fork_independent"
        in out
    )
    assert "contract: fork is an independent copy" in out


def test_pytest_plugin_marker_selects_only_the_properties(tmp_path):
    # a user's own test whose name says "conformance": -k conformance would run it too
    (tmp_path / "test_mine.py").write_text(
        "def test_my_conformance_helper():\n    raise AssertionError('ran')\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])
    )
    base = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(tmp_path),
        "--spec-grammar-backend",
        "broken_adapter:ForkSharesState",
        "--spec-grammar-tokenizer",
        "toy",
    ]
    proc = subprocess.run(
        [*base, "-m", "spec_grammar_conformance", "-k", "toy_fork_independent or toy_T8"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    out = proc.stdout
    assert "test_my_conformance_helper" not in out and "ran" not in out, out[-3000:]
    m = re.search(r"(\d+) failed, (\d+) passed, (\d+) deselected", out)
    assert m and (int(m[1]), int(m[2])) == (1, 1), out[
        -3000:
    ]  # fork fails on this adapter, T8 passes


# -- cross-backend: JSON-Schema-Test-Suite acceptance ------------------------------------------
def test_json_suite_differences():
    if not AVAILABLE:
        pytest.skip("no backend installed")
    json_backends = [
        b.name for b in list_backends() if b.error is None and b.capabilities.json_schema
    ]
    tok, width = fixture_tokenizer("smollm2")
    cases = suite_cases()
    outcomes = {
        name: acceptance(get_backend(name, tok, vocab_size=width), cases) for name in json_backends
    }
    rows = compare_backends(outcomes, cases)
    # The table is the report users read; pytest shows it with -s (or on failure).
    print(
        f"\nJSON-Schema-Test-Suite, {len(cases)} instances: {len(rows)} differ from jsonschema or a backend"
    )
    print(format_table(rows, json_backends))
    for name, res in outcomes.items():
        assert set(res) == {c.key for c in cases}
        bad = unsound_cases(name, res, cases)
        assert not bad, (
            f"{name} accepts instances jsonschema rejects: {[(c.key, c.text[:60]) for c in bad]}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", AVAILABLE)
def test_backend_conforms_long_mode(backend):
    results = run_conformance(resolve_factory(backend), slow=True)
    bad = [r for r in results if r.status in ("FAIL", "ERROR")]
    assert not bad, "\n\n".join(r.detail for r in bad)
