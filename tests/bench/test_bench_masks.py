"""The tree-mask benchmark on a toy scale: it runs end to end through the CLI, writes every
report file, and its numbers agree with each other and with the regenerated docs page. No
timing thresholds (speed claims come from the full run, not from tests)."""

from __future__ import annotations

import json
import math

import pytest

from spec_grammar.cli import main

pytestmark = pytest.mark.integration  # runs the bench CLI

pytest.importorskip("xgrammar")
pytest.importorskip("matplotlib")

SIZES = [8, 16]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("masks")
    code = main(
        [
            "bench",
            "masks",
            "--quick",
            "--out",
            str(out),
            "--tokenizers",
            "smollm2",
            "--backends",
            "xgrammar",
            "--sizes",
            ",".join(map(str, SIZES)),
            "--requests",
            "1,2",
            "--threads",
            "1,2",
            "--reps",
            "2",
            "--compile-cases",
            "1",
        ]
    )
    assert code == 0, "the benchmark's own consistency checks failed (see its output)"
    return out


@pytest.fixture(scope="module")
def result(run_dir):
    return json.loads((run_dir / "masks.json").read_text())


def test_report_files_exist(run_dir):
    for name in ("masks.json", "masks.md", "compile_ms.png", "tree_us_per_node.png", "speedup.png"):
        path = run_dir / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in ("compile_ms.png", "tree_us_per_node.png", "speedup.png"):
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compile_counts_add_up(result):
    (entry,) = result["compile"]
    assert entry["backend"] == "xgrammar" and entry["tokenizer"] == "smollm2"
    cases = entry["cases"]
    assert {c["source"] for c in cases} == {"jsonschemabench", "bfcl"}
    for source, s in entry["summary"].items():
        mine = [c for c in cases if source in ("all", c["source"])]
        assert s["total"] == len(mine) == s["ok"] + s["failed"] + s["timeout"] + s["skipped"]
        oks = sorted(c["ms"] for c in mine if c["status"] == "ok")
        assert s["ok"] == len(oks)
        if oks:
            assert oks[0] <= s["median_ms"] <= s["p90_ms"] <= oks[-1]
    for c in cases:
        assert (c["status"] == "ok") == (c["error"] is None)


def test_tree_numbers_consistent(result):
    assert result["problems"] == []
    recs = result["trees"]
    setup = {t["nodes"]: t for t in result["tree_setup"][0]["trees"]}
    assert sorted(setup) == SIZES
    seen = set()
    for r in recs:
        n = r["nodes"]
        seen.add((r["method"], n, r["requests"], r["threads"]))
        assert 1 <= r["visited_mean"] <= n
        assert r["us_per_tree"] > 0 and r["cold_us_per_node"] > 0
        if r["requests"] == 1:
            # means over roots of per-root medians
            assert math.isclose(r["us_per_node"] * n, r["us_per_tree"], rel_tol=1e-9)
            assert r["us_per_visited_min"] <= r["us_per_visited"] <= r["us_per_visited_max"]
            assert math.isclose(r["visited_mean"], setup[n]["valid_mean"], rel_tol=1e-9)
        else:
            # one batch: per-tree, per-node and per-visited are the same time divided differently
            assert math.isclose(
                r["us_per_tree"] * r["requests"], r["us_per_node"] * n * r["requests"], rel_tol=1e-9
            )
            assert math.isclose(
                r["us_per_visited"] * r["visited_mean"], r["us_per_tree"], rel_tol=1e-9
            )
    for n in SIZES:
        for method in ("ours", "hook", "naive", "native"):
            assert (method, n, 1, 1) in seen
        assert {("ours", n, 2, 1), ("ours", n, 2, 2), ("naive", n, 2, 1)} <= seen


def test_markdown_and_docs_show_the_json_numbers(run_dir, result, tmp_path):
    from spec_grammar_bench.masks_report import _f, speedups

    md = (run_dir / "masks.md").read_text()
    ours8 = next(
        r
        for r in result["trees"]
        if r["method"] == "ours" and r["nodes"] == 8 and r["requests"] == 1
    )
    assert f"{_f(ours8['us_per_node'])} ({_f(ours8['us_per_visited'])})" in md
    sp = speedups(result)
    assert len(sp) == len(SIZES) * 3  # (1 request, 1 thread), (2, 1), (2, 2)
    for s in sp:
        assert f"{s['speedup']:.2f}x" in md
        assert math.isclose(
            s["speedup"], s["naive_us_per_node"] / s["ours_us_per_node"], rel_tol=1e-9
        )
    docs = tmp_path / "docs" / "benchmarks.md"
    assert main(["bench", "report", "--from", str(run_dir), "--docs", str(docs)]) == 0
    page = docs.read_text()
    assert "do not edit by hand" in page
    assert f"{_f(ours8['us_per_node'])} ({_f(ours8['us_per_visited'])})" in page
    assert "speedup.png" in page


def test_report_needs_results(tmp_path):
    assert main(["bench", "report", "--from", str(tmp_path), "--docs", str(tmp_path / "b.md")]) == 2


def test_default_backends_are_those_that_compile_json_schemas():
    """The bench compiles JSON schemas: a regex-only backend (the example adapter CI installs)
    is listed with the reason instead of giving empty tables."""
    from spec_grammar_bench.masks import MaskBenchConfig, _select_backends

    from spec_grammar.registry import list_backends

    chosen, listing = _select_backends(MaskBenchConfig())
    by_name = {b["name"]: b for b in listing}
    for info in list_backends():
        if info.error is None:
            assert (info.name in chosen) == info.capabilities.json_schema
            if not info.capabilities.json_schema:
                assert by_name[info.name]["error"] == "no JSON-schema support"
    assert "xgrammar" in chosen


def test_cli_help_does_not_import_the_bench_package():
    """The benchmarks live outside the core library: building the CLI (``--help``) leaves them
    unloaded; they load when a bench subcommand runs."""
    import subprocess
    import sys

    code = (
        "import sys; from spec_grammar.cli import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('spec_grammar_bench')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("missing", ["spec_grammar_bench", "matplotlib"])
def test_bench_without_its_package_or_matplotlib_is_one_clear_line(
    monkeypatch, capsys, tmp_path, missing
):
    import sys

    class NotInstalled:  # finds nothing under ``missing``, as where it is not installed
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == missing or fullname.startswith(f"{missing}."):
                raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
            return None

    for name in list(sys.modules):
        if name == missing or name.startswith(f"{missing}."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled, *sys.meta_path])
    rc = main(["bench", "report", "--from", str(tmp_path), "--docs", str(tmp_path / "b.md")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("spec-grammar bench: error: ") and missing in err
    assert "pip install" in err
