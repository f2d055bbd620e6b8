"""The end-to-end benchmark on a toy scale (2 real prompts, 8 new tokens, real SmolLM2): it runs
through the CLI, writes every report file, its numbers agree with its samples and with the
regenerated docs page, and our constrained outputs pass the oracles (a fresh xgrammar matcher
accepts every output; ``jsonschema`` validates every completed one). No timing thresholds."""

from __future__ import annotations

import json

import pytest

from spec_grammar.cli import main

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("matplotlib")

MAX_NEW = 8
ROWS = {
    "ours-spec/xgrammar",
    "ours-nospec/xgrammar",
    "ours-spec/unconstrained",
    "hf/xgrammar",
    "hf/xgrammar+pld",
}

# every test reads one quick e2e run of the real model
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    code = main(
        [
            "bench",
            "e2e",
            "--quick",
            "--out",
            str(out),
            "--max-new-tokens",
            str(MAX_NEW),
            "--hf-processors",
            "xgrammar",
            "--hf-speculation",
            "none,prompt_lookup",
        ]
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def result(run_dir):
    return json.loads((run_dir / "e2e.json").read_text())


def test_report_files_exist(run_dir):
    for name in (
        "e2e.json",
        "e2e.md",
        "e2e_tokens_per_s.png",
        "e2e_accept_length.png",
        "e2e_outcomes.png",
    ):
        path = run_dir / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_row_ran_every_prompt(result):
    assert {r["id"] for r in result["rows"]} == ROWS
    assert len(result["prompts"]) == 2 and {p["source"] for p in result["prompts"]} == {
        "jsonschemabench",
        "bfcl",
    }
    pairs = [(s["row"], s["prompt"]) for s in result["samples"]]
    assert sorted(pairs) == sorted((r, p["name"]) for r in ROWS for p in result["prompts"])
    for s in result["samples"]:
        assert (s["status"] == "ok") == (s["error"] is None), s
        if s["row"].startswith("ours") or s["row"] == "hf/xgrammar":
            assert s["status"] == "ok", s  # only HF speculation is allowed to fail (it is recorded)


def test_summary_matches_samples(result):
    for row in result["summary"]:
        mine = [s for s in result["samples"] if s["row"] == row["row"]]
        ok = [s for s in mine if s["status"] == "ok"]
        assert row["prompts"] == len(mine) and row["ok"] + row["errors"] == len(mine)
        assert sum(row["error_counts"].values()) == row["errors"]
        assert row["tokens"] == sum(len(s["token_ids"]) for s in ok)
        assert row["completed"] + row["cut"] <= row["ok"] and row["valid"] <= row["completed"]
        if row["tokens"]:
            assert row["tokens_per_s"] == pytest.approx(
                row["tokens"] / sum(s["wall_s"] for s in ok)
            )
            assert row["accept_length"] == pytest.approx(
                row["tokens"] / sum(s["forwards"] for s in ok)
            )
        for s in ok:
            assert s["tokens"] == len(s["token_ids"]) <= MAX_NEW
            assert (s["finish"] == "length") == (
                s["tokens"] == MAX_NEW and s["finish"] != "complete"
            )
            assert (s["valid"] is None) == (s["finish"] != "complete")
        if row["row"] == "ours-nospec/xgrammar":
            assert row["accept_length"] == pytest.approx(
                1.0, abs=0.15
            )  # one token per forward (+ the stop step)


def test_constrained_outputs_pass_the_oracles(result):
    """Fresh-matcher replay of every constrained output, and jsonschema on completed ones."""
    import jsonschema
    from spec_grammar_bench.e2e import E2EBenchConfig, load_prompts

    from spec_grammar.models import load_model, load_tokenizer

    tok = load_tokenizer("smollm2")
    prompts = {p.name: p for p in load_prompts(E2EBenchConfig.quick(), tok)}
    vocab = int(load_model("smollm2").config.vocab_size)
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab, stop_token_ids=result["meta"]["stop_token_ids"]
        )
    )
    for s in result["samples"]:
        if s["status"] != "ok" or s["row"] == "ours-spec/unconstrained":
            continue
        p = prompts[s["prompt"]]
        spec = p.spec.to_json_schema() if hasattr(p.spec, "to_json_schema") else p.spec
        matcher = xgr.GrammarMatcher(
            compiler.compile_json_schema(
                spec.schema_json(), any_whitespace=False, separators=(", ", ": ")
            )
        )
        for t in s["token_ids"]:
            assert matcher.accept_token(t), (s["row"], s["prompt"], t)
        if s["finish"] == "complete":
            assert matcher.can_terminate()
            doc = json.loads(s["text"])
            assert s["valid"] == jsonschema.Draft202012Validator(p.schema).is_valid(doc)
            if s["row"].startswith("ours"):
                assert s["valid"], s


def test_identity_fields_agree_with_tokens(result):
    by = {(s["row"], s["prompt"]): s for s in result["samples"]}
    for s in result["samples"]:
        if "identical" not in s:
            continue
        ref = by[("hf/xgrammar", s["prompt"])]
        assert s["identical"] == (s["token_ids"] == ref["token_ids"])
        assert ("divergence" in s) == (not s["identical"])
    unc = [s for s in result["samples"] if s["row"] == "ours-spec/unconstrained"]
    assert all("identical" not in s for s in unc)


def test_docs_page_regenerates_from_json(run_dir, result, tmp_path):
    docs = tmp_path / "benchmarks.md"
    assert main(["bench", "report", "--from", str(run_dir), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "## End-to-end generation" in text and "vs HF + xgrammar" in text
    summary = {r["row"]: r for r in result["summary"]}
    ref = summary["hf/xgrammar"]
    assert f"{ref['tokens_per_s']:.1f}" in text or f"{ref['tokens_per_s']:,.0f}" in text
    # the headline table comes before the detailed section
    assert text.index("vs HF + xgrammar") < text.index("## End-to-end generation")
