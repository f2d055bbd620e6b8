"""Options, markers and fixtures shared by the whole suite.

- ``--run-slow`` un-skips ``@pytest.mark.slow``; ``@pytest.mark.gpu`` tests skip without CUDA.
- ``tok`` / ``model``: the default model's tokenizer and float32 model, loaded once per session.
  Tests that need float64 outputs (spec vs no-spec greedy parity) use
  ``real_model.model_and_tokenizer()`` from ``tests/support/``.
- Lanes: ``pytest -m unit`` runs the tests marked none of ``model`` (loads the real model),
  ``integration`` (a subprocess, a native build, a sweep over real inputs, the tiny-model worker
  run end to end for seconds), ``slow``, ``gpu``,
  ``vllm``: the lane a change is checked with first (``unit`` is set here, by
  :func:`pytest_collection_modifyitems`). A test not marked ``model`` that loads the real model
  fails (:func:`pytest_configure`).
- ``SPEC_GRAMMAR_ISOLATION=thread`` unless set: compiles run in threads except where a test
  passes ``isolation="process"``.
"""

from __future__ import annotations

import os

import pytest

# compiles in this process's threads: a compile process per backend (seconds to start, ~300 MB
# each) for every backend the suite builds would cost more than the suite's time; the tests of
# the process path (tests/reliability/test_compile_isolation.py) ask for it by name
os.environ.setdefault("SPEC_GRAMMAR_ISOLATION", "thread")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run tests marked slow"
    )
    parser.addoption(
        "--memory-report",
        action="store_true",
        default=False,
        help="print the tests that raised the process's peak RSS most (and the RSS after each "
        "module), to find what holds the suite's memory",
    )


_NOT_UNIT = ("model", "integration", "slow", "gpu", "vllm")


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow")
    cuda = None
    for item in items:
        if not any(item.get_closest_marker(m) for m in _NOT_UNIT):
            item.add_marker(pytest.mark.unit)
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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the objects that exist once every test module is imported (torch's, the grammar
    libraries', the tests' own: ~380,000) out of the cycle collector's scans: every full
    collection, automatic or each module's :func:`_release_module_caches`, walked them all
    again (0.2 s each, ~0.4 s on a loaded host; a tenth of the unit lane's time). What the
    tests build later is collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    # frozen objects are skipped by the collection at interpreter exit too: nanobind then
    # reports the triton objects it finds alive as leaks
    import gc

    gc.unfreeze()


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


_peak_steps: list[tuple[float, str]] = []  # (MiB the test raised the peak RSS by, test id)
_module_rss: dict[str, float] = {}  # module -> current RSS (MiB) after its last test


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (Linux /proc)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        current = float("nan")
    return current, peak


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running[0] = item
    report = item.config.getoption("--memory-report")
    before = _rss_mib()[1] if report else 0.0
    try:
        yield
    finally:
        _running[0] = None
        if report:
            current, peak = _rss_mib()
            if peak > before:
                _peak_steps.append((peak - before, item.nodeid))
            _module_rss[item.nodeid.split("::")[0]] = current


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if not config.getoption("--memory-report"):
        return
    tr = terminalreporter
    tr.section("memory: tests that raised the peak RSS most")
    for mib, nodeid in sorted(_peak_steps, reverse=True)[:15]:
        tr.write_line(f"{mib:9.0f} MiB  {nodeid}")
    tr.section("memory: RSS after each module (MiB)")
    for module, mib in _module_rss.items():
        tr.write_line(f"{mib:9.0f}  {module}")
    tr.write_line(f"peak RSS {_rss_mib()[1]:.0f} MiB")


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


@pytest.fixture(autouse=True, scope="module")
def _release_module_caches(request: pytest.FixtureRequest):
    """After each test module, drop what it cached for itself: its module-level
    ``functools.cache`` functions (workers, backends with their compiled grammars, reference
    outputs, float64 models), the shared grammar backends of ``tests/support/real_model.py``
    (an outlines backend keeps up to 16 compiled indexes, some of several GB) and the worker
    API's per-process model / backend / tokenizer caches. Kept for the session: the ``tok`` and
    ``model`` fixtures and ``real_model.model_and_tokenizer`` (shared by many modules, cheap to
    hold next to a reload each time). Without this every module's caches lived until the
    session ended and the suite's memory peak grew with the number of modules."""
    import gc
    import sys

    yield
    module = request.module
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) == module.__name__ and callable(
            getattr(value, "cache_clear", None)
        ):
            value.cache_clear()
    real_model = sys.modules.get("real_model")
    if real_model is not None:
        real_model.backend.cache_clear()
        real_model.vocab_size.cache_clear()
    api = sys.modules.get("spec_grammar.worker.api")
    if api is not None:
        with api._lock:
            api._models.clear()
            api._backends.clear()
        with api._tokenizer_lock:
            api._tokenizers.clear()
    gc.collect()
