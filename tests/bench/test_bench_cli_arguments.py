"""``spec-grammar bench`` with output paths it cannot write and nonsense counts: one line
naming the argument (exit 2) before the benchmark runs, not a traceback after it."""

from __future__ import annotations

import pytest

from spec_grammar.cli import main

pytest.importorskip("matplotlib")
masks = pytest.importorskip("spec_grammar_bench.masks")
e2e = pytest.importorskip("spec_grammar_bench.e2e")
gpu = pytest.importorskip("spec_grammar_bench.gpu")


@pytest.fixture
def no_bench_run(monkeypatch):
    """Fail the test if a benchmark starts (its work would be lost to the path error)."""

    def refuse(*_a, **_k):
        raise AssertionError("the benchmark ran before the argument error was reported")

    monkeypatch.setattr(masks, "run_masks", refuse)
    monkeypatch.setattr(e2e, "run_e2e", refuse)
    monkeypatch.setattr(gpu, "run_gpu_bench", refuse)


def one_error_line(capsys, rc: int, *needles: str) -> str:
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith("spec-grammar bench: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for n in needles:
        assert n in lines[0], captured.err
    return lines[0]


QUICK = {"masks": ["--quick"], "e2e": ["--quick"], "gpu": ["--quick"]}


@pytest.mark.parametrize("bench", ["masks", "e2e", "gpu"])
def test_out_is_a_file(capsys, tmp_path, no_bench_run, bench):
    """masks ran to the end, then died with FileExistsError's traceback writing the report."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = main(["bench", bench, *QUICK[bench], "--out", str(afile)])
    one_error_line(capsys, rc, f"--out {afile} is a file, not a directory")
    assert afile.read_text() == "x"
    rc = main(["bench", bench, *QUICK[bench], "--out", str(afile / "sub")])
    one_error_line(capsys, rc, f"{afile} is a file, not a directory")


@pytest.mark.parametrize("bench", ["masks", "gpu"])
def test_out_that_cannot_be_created(capsys, no_bench_run, bench):
    rc = main(["bench", bench, *QUICK[bench], "--out", "/proc/no-such-dir/out"])
    one_error_line(capsys, rc, "--out /proc/no-such-dir/out: cannot create")


def test_docs_paths(capsys, tmp_path, no_bench_run):
    """``report --docs`` under a file died with FileExistsError's traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = main(["bench", "masks", "--quick", "--out", str(tmp_path / "o"), "--docs", str(tmp_path)])
    one_error_line(capsys, rc, f"--docs {tmp_path} is a directory, not a file")
    rc = main(["bench", "report", "--from", str(tmp_path), "--docs", str(afile / "b.md")])
    one_error_line(capsys, rc, f"--docs {afile / 'b.md'}: {afile} is a file, not a directory")


@pytest.mark.parametrize(
    "flags, needles",
    [
        # were "rows [0, 1) do not fit a bitmask with 0 rows" after the compile phase
        (["--sizes", "0"], ["--sizes: Input should be greater than 0 (got 0)"]),
        # was "no median for empty data" after the compile phase
        (["--threads", "0", "--reps", "-1"], ["--threads: ", "--reps: "]),
        (["--sizes", ","], ["--sizes: List should have at least 1 item"]),
        (["--requests", "-2"], ["--requests: "]),
        (["--compile-cases", "0"], ["--compile-cases: "]),
        (["--compile-timeout", "0"], ["--compile-timeout: "]),
    ],
)
def test_masks_counts_are_positive(capsys, tmp_path, no_bench_run, flags, needles):
    out = tmp_path / "out"
    rc = main(["bench", "masks", "--quick", "--out", str(out), *flags])
    one_error_line(capsys, rc, *needles)
    assert not out.exists()  # nothing written for an invalid run


def test_masks_with_no_usable_tokenizer_is_an_error(capsys, tmp_path):
    """It exited 0 with a report of nothing measured (every tokenizer "skipped")."""
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "masks",
            "--quick",
            "--out",
            str(out),
            "--tokenizers",
            "nosuch",
            "--backends",
            "xgrammar",
        ]
    )
    one_error_line(capsys, rc, "no usable tokenizer among nosuch (model 'nosuch' not found")
    assert not (out / "masks.json").exists()


@pytest.mark.parametrize(
    "flags, needles",
    [
        # -1 sliced the case list from its end (all cases but the last)
        (["--schemas", "-1"], ["--schemas: Input should be greater than or equal to 0 (got -1)"]),
        (["--bfcl", "-2"], ["--bfcl: "]),
        (["--schemas", "0", "--bfcl", "0"], ["no prompts: jsb_cases and bfcl_cases are both 0"]),
        (["--time-budget", "0"], ["--time-budget: "]),
        (["--time-budget", "nan"], ["--time-budget: "]),
    ],
)
def test_e2e_counts_are_checked_in_one_line(capsys, tmp_path, no_bench_run, flags, needles):
    out = tmp_path / "out"
    rc = main(["bench", "e2e", "--quick", "--out", str(out), *flags])
    one_error_line(capsys, rc, *needles)
    assert not out.exists()


@pytest.mark.parametrize("kind", ["masks", "e2e"])
def test_report_of_an_unreadable_result_file_is_one_line(capsys, tmp_path, kind):
    """A result file that names its kind but lacks what its renderer reads (cut short, or from
    another version) ended ``bench report`` with a KeyError traceback."""
    results = tmp_path / "results"
    results.mkdir()
    (results / f"{kind}.json").write_text(f'{{"kind": "{kind}"}}')
    rc = main(["bench", "report", "--from", str(results), "--docs", str(tmp_path / "b.md")])
    one_error_line(capsys, rc, f"{results / (kind + '.json')}: a '{kind}' result file")
