"""The test suite's own layout: every folder collects alone (no test module depends on one of
another folder being imported first), the markers skip what they name and nothing else, and a
test that loads the real model carries the ``model`` marker (the fast lane stays fast).

Each check runs pytest in a subprocess on the real tree or on a scratch folder with a copy of
``tests/conftest.py``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))


def pytest_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_folders_are_the_documented_ones():
    assert {"adapters", "bench", "cli", "conformance", "core", "reliability", "worker"} <= set(
        FOLDERS
    )


@pytest.mark.integration  # a pytest subprocess per folder
@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_collects_alone(folder):
    run = pytest_in(TESTS.parent, f"tests/{folder}", "--collect-only", "-q")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.lower().splitlines()[-1], run.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(TESTS)) for p in TESTS.glob("*/test_*.py"))
)
def test_each_file_collects_alone_from_its_own_folder(path):
    """Run as ``cd tests/reliability && pytest test_reliability_lazy.py``: the shared helpers
    come from the project's pythonpath setting, a sibling module from the file's folder."""
    file = TESTS / path
    run = pytest_in(file.parent, file.name, "--collect-only", "-q")
    assert run.returncode in (0, 5), run.stdout[-3000:] + run.stderr[-3000:]  # 5: all deselected


SCRATCH_TESTS = """
import pytest


@pytest.mark.parametrize("kind", ["cpu", "gpu", "slow", "model"])
def test_param_ids_are_no_markers(kind):
    pass


@pytest.mark.slow
def test_slow_is_skipped():
    pass


def test_an_unmarked_test_cannot_load_the_real_model():
    from spec_grammar.models import load_model

    with pytest.raises(RuntimeError, match="is not marked @pytest.mark.model"):
        load_model("smollm2")
    with pytest.raises(RuntimeError, match="is not marked @pytest.mark.model"):
        load_model()


@pytest.mark.model
def test_a_marked_test_reaches_the_loader(monkeypatch):
    import spec_grammar.models as models

    assert getattr(models.load_model, "_guarded", False)
"""


@pytest.mark.integration  # a pytest subprocess
def test_markers_skip_what_they_name_and_guard_the_real_model(tmp_path):
    """``"gpu" in item.keywords`` also matched a parametrize id: a test parametrized over
    ``["masks", "gpu"]`` had its ``gpu`` case skipped ("gpu: no CUDA device") everywhere."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_scratch.py").write_text(SCRATCH_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow\n    gpu\n    model\n")
    run = pytest_in(tmp_path, "-q", "-rs", "test_scratch.py")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "6 passed, 1 skipped" in run.stdout, run.stdout[-3000:]
    assert "slow: run with --run-slow" in run.stdout and "no CUDA device" not in run.stdout
