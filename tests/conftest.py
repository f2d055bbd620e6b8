"""Options, markers and fixtures shared by the whole suite.

- ``--run-slow`` un-skips ``@pytest.mark.slow``; ``@pytest.mark.gpu`` tests skip without CUDA.
- ``tok`` / ``model``: the default model's tokenizer and float32 model, loaded once per session.
  Tests that need float64 outputs (spec vs no-spec greedy parity) use
  ``real_model.model_and_tokenizer()`` from ``tests/support/``.
- Fast lane: ``pytest -m "not model"`` leaves out the tests that run the real model; a test
  not marked ``model`` that loads it fails (:func:`pytest_configure`).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run tests marked slow"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow")
    cuda = None
    for item in items:
        # the markers, not item.keywords: those also hold every parametrize id, so a test
        # parametrized over ["masks", "gpu"] had its "gpu" case skipped on every machine
        if item.get_closest_marker("slow") is not None and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow"))
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device"))


_REAL_MODELS = ("smollm2", "gemma3")
_running: list[pytest.Item | None] = [None]


def pytest_configure(config: pytest.Config) -> None:
    """``load_model`` of a real checkpoint from a test not marked ``model`` raises: the fast
    lane (``-m "not model"``) must not load it (a session fixture or a helper that loads it
    to read one number is easy to miss; three CLI tests and the schema tests did)."""
    import spec_grammar.models as models

    real = models.load_model
    if getattr(real, "_guarded", False):
        return

    def load_model(name_or_path=models.DEFAULT_MODEL, *args, **kwargs):
        item = _running[0]
        if (
            item is not None
            and item.get_closest_marker("model") is None
            and str(name_or_path) in _REAL_MODELS
        ):
            raise RuntimeError(
                f"{item.nodeid} loads the real model {name_or_path!r} but is not marked "
                "@pytest.mark.model"
            )
        return real(name_or_path, *args, **kwargs)

    load_model._guarded = True
    models.load_model = load_model


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running[0] = item
    try:
        yield
    finally:
        _running[0] = None


@pytest.fixture(scope="session")
def tok():
    """The default model's (SmolLM2-135M-Instruct) Hugging Face tokenizer, vocab 49,152."""
    from spec_grammar.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def model():
    """The default model in float32 on the CPU (tests that change its config restore it)."""
    from spec_grammar.models import load_model

    return load_model("smollm2")
