"""pytest plugin (entry point ``pytest11: spec_grammar``): one test per conformance property.

``pytest --spec-grammar-backend NAME|module:Class [--spec-grammar-tokenizer toy|smollm2]
[--spec-grammar-slow]`` adds the items ``spec-grammar-conformance[NAME]::<property>`` to the
session, next to whatever else is collected, each marked ``spec_grammar_conformance`` (``-m
spec_grammar_conformance`` runs only them; ``-k`` selects among them by property name). Without
the option the plugin adds nothing and imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

import pytest

_SESSIONS_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spec-grammar", "spec-grammar backend conformance")
    group.addoption(
        "--spec-grammar-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the conformance suite on this backend (registered name or module:Class); repeatable",
    )
    group.addoption(
        "--spec-grammar-tokenizer",
        action="append",
        choices=["toy", "smollm2"],
        default=[],
        help="fixture tokenizers to run on (default: both)",
    )
    group.addoption(
        "--spec-grammar-slow", action="store_true", help="long mode: more random examples"
    )


MARKER = "spec_grammar_conformance"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: a spec-grammar conformance property (--spec-grammar-backend)"
    )


class ConformanceItem(pytest.Item):
    """One property on one backend."""

    def __init__(self, *, backend: str, prop: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.backend_name = backend
        self.prop = prop
        self.add_marker(MARKER)

    def runtest(self) -> None:
        from .core import Session
        from .suite import resolve_factory, run_property

        sessions = self.config.stash.setdefault(_SESSIONS_KEY, {})
        if self.backend_name not in sessions:
            slow = self.config.getoption("--spec-grammar-slow")
            sessions[self.backend_name] = Session(resolve_factory(self.backend_name), slow=slow)
        result = run_property(self.prop, sessions[self.backend_name])
        if result.status == "SKIP":
            pytest.skip(result.detail)
        if result.status != "PASS":
            raise _PropertyFailed(result.detail)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> Any:
        if isinstance(excinfo.value, _PropertyFailed):
            return f"{self.prop.name} on {self.backend_name}\n{excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"spec-grammar conformance: {self.backend_name} {self.prop.name}"


class _PropertyFailed(Exception):
    pass


class ConformanceSuite(pytest.Collector):
    """The suite's properties for one backend."""

    def __init__(self, *, backend: str, fixtures: list[str], **kwargs: Any):
        super().__init__(**kwargs)
        self.backend_name = backend
        self.fixtures = fixtures

    def collect(self) -> list[pytest.Item]:
        from .suite import select_properties

        return [
            ConformanceItem.from_parent(self, name=p.name, backend=self.backend_name, prop=p)
            for p in select_properties(self.fixtures)
        ]


@pytest.hookimpl(tryfirst=True)  # added before -k / -m deselect, so that they select these too
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    backends = config.getoption("--spec-grammar-backend")
    fixtures = config.getoption("--spec-grammar-tokenizer") or ["toy", "smollm2"]
    if backends:
        from ..errors import BackendNotFoundError
        from .suite import resolve_factory

        for name in backends:
            try:
                resolve_factory(name)
            except BackendNotFoundError as e:
                raise pytest.UsageError(f"--spec-grammar-backend {name}: {e}") from None
    for name in backends:
        suite = ConformanceSuite.from_parent(
            session, name=f"spec-grammar-conformance[{name}]", backend=name, fixtures=fixtures
        )
        items.extend(suite.collect())
