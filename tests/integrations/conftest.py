"""Fixtures of the serving-engine integration tests.

SGLang imports ``torchvision`` unguarded (``srt/multimodal/internvl_utils.py``, reached from
``srt/configs``), and PyPI's torchvision does not load beside CPU torch (it pins its own
CUDA torch). When torchvision is absent, :func:`install_torchvision_stub` puts a stub in its
place before SGLang is imported: test code only; nothing here runs a vision model. transformers
is asked first, so it records torchvision as unavailable and never uses the stub.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest


class _Anything(types.ModuleType):
    """A module whose every attribute is another stub (``T.InterpolationMode.BICUBIC``)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return _Anything(f"{self.__name__}()")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_torchvision_stub() -> None:
    """Stub ``torchvision`` when SGLang is installed and torchvision is not (idempotent);
    elsewhere (CI's venv) nothing changes."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    if importlib.util.find_spec("sglang") is None:
        return
    if importlib.util.find_spec("torchvision") is not None:
        return
    try:  # cache transformers' answer (False) before the stub exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except ImportError:
        pass
    sys.meta_path.insert(0, _StubFinder())


install_torchvision_stub()


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The SmolLM2 directory our loader writes (converted once into the cache), for the vLLM
    tests."""
    from spec_grammar.models import load_model

    path = Path(load_model("smollm2").name_or_path)
    config = json.loads((path / "config.json").read_text())
    if "architectures" not in config or not (path / "tokenizer.json").exists():
        pytest.fail(
            f"{path} was written before the loader wrote complete model directories "
            "(no architectures / tokenizer): delete it or set SPEC_GRAMMAR_CACHE elsewhere"
        )
    return str(path)
