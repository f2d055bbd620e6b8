"""The kernel benchmark's report: the committed H200 report and docs section are rendered from
its JSON result (every number read from it), and a toy CPU run writes a ``kernels`` result that
``bench report`` puts on the docs page. No timing thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec_grammar.cli import main

pytestmark = pytest.mark.integration  # runs the bench CLI

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "benchmarks" / "results" / "kernels-h200.json"


def _render(result: dict) -> str:
    from spec_grammar_bench.kernels_report import render_kernels_markdown

    return render_kernels_markdown(result)


def test_h200_report_is_rendered_from_its_json():
    result = json.loads(H200.read_text())
    assert result["kind"] == "kernels"
    text = _render(result)
    report = (H200.parent / "kernels-h200.md").read_text()
    assert report.endswith(text)
    assert text in (ROOT / "docs" / "benchmarks.md").read_text()
    for cell in result["cells"]:
        section = text.split(f"### {cell['mask']} masks: apply")[1].split("###")[0]
        t, e = cell["ms"], cell["eager_ms"]
        start = f"| {cell['rows']} | {cell['vocab']:,} | {cell['dtype']} | "
        (row,) = [line for line in section.splitlines() if line.startswith(start)]
        assert f"{t['xgrammar-cuda'] / t['spec_grammar']:.2f}x" in row
        assert f"{e['xgrammar-cuda'] / e['spec_grammar']:.2f}x" in row
        assert row.endswith("| ok |") and all(cell["checks"].values())


def test_cpu_run_writes_a_kernels_result_for_the_docs(tmp_path):
    pytest.importorskip("xgrammar")
    out = tmp_path / "kernels"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--device", "cpu"]
    cmd += ["--rows", "2", "--vocabs", "256", "--masks", "random", "--out", str(out)]
    cmd += ["--tag", "toy"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "kernels-toy.json").read_text())
    assert result["kind"] == "kernels"
    assert [c["checks"] for c in result["cells"]] and all(
        all(c["checks"].values()) for c in result["cells"]
    )
    assert (out / "kernels-toy.md").read_text().endswith(_render(result))
    docs = tmp_path / "benchmarks.md"
    assert main(["bench", "report", "--from", str(out), "--docs", str(docs)]) == 0
    assert _render(result) in docs.read_text()
