"""The SGLang plugin's packaging, checked without SGLang: the entry point SGLang's
``load_plugins()`` reads, the pinned extra, and the backend names the plugin registers."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import spec_grammar.integrations.sglang as plugin
from spec_grammar.registry import ENTRY_POINT_GROUP

PYPROJECT = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())


def test_entry_point_names_the_register_function():
    target = PYPROJECT["project"]["entry-points"]["sglang.srt.plugins"]["spec_grammar"]
    module, _, attr = target.partition(":")
    assert getattr(importlib.import_module(module), attr) is plugin.register


def test_extra_pins_the_tested_sglang():
    assert PYPROJECT["project"]["optional-dependencies"]["sglang"] == ["sglang==0.5.23"]


def test_backend_names_cover_every_registered_backend():
    names = plugin.backend_names()
    registered = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert names == sorted(plugin.PREFIX + n for n in registered | {"auto"})  # routing, built in
    assert {
        "spec-grammar:auto",
        "spec-grammar:xgrammar",
        "spec-grammar:llguidance",
        "spec-grammar:outlines",
    } <= set(names)


def test_importing_the_plugin_does_not_import_sglang():
    assert "spec_grammar.integrations.sglang" in sys.modules
    if importlib.util.find_spec("sglang") is None:
        assert "sglang" not in sys.modules
        with pytest.raises(ModuleNotFoundError, match="sglang"):
            plugin.register()
