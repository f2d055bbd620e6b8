"""Options, markers and fixtures shared by the whole suite.

- ``--run-slow`` un-skips ``@pytest.mark.slow``; ``@pytest.mark.gpu`` tests skip without CUDA.
- ``tok`` / ``model``: the default model's tokenizer and float32 model, loaded once per session.
  Tests that need float64 outputs (spec vs no-spec greedy parity) use
  ``real_model.model_and_tokenizer()`` from ``tests/support/``.
- Fast lane: ``pytest -m "not model"`` leaves out the tests that run the real model.
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
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow"))
        if "gpu" in item.keywords:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device"))


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
