"""Run registered properties against one backend and collect the results."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

from ..registry import load_backend_class
from .core import PROPERTIES, BackendFactory, ConformanceFailure, Property, PropertySkipped, Session

__all__ = [
    "PropertyResult",
    "select_properties",
    "run_property",
    "run_conformance",
    "resolve_factory",
]

Status = Literal["PASS", "FAIL", "SKIP", "ERROR"]


@dataclass
class PropertyResult:
    """Outcome of one property: ``status`` PASS / FAIL (contract broken) / SKIP (not applicable)
    / ERROR (an unexpected exception: also a conformance failure, since the protocol promises
    typed errors); ``detail`` is the failure report; ``seconds`` the wall time."""

    name: str
    contract: str
    fixture: str
    status: Status
    detail: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_factory(name: str) -> BackendFactory:
    """The backend class for a registered name or ``module:Class`` (a class is a factory).
    Raises :class:`~spec_grammar.errors.BackendNotFoundError`."""
    return load_backend_class(name)


def select_properties(
    fixtures: Iterable[str] = ("toy", "smollm2"), names: Iterable[str] | None = None
) -> list[Property]:
    """Registered properties on the given fixture tokenizers (optionally only ``names``)."""
    from . import properties  # noqa: F401  (registers every property)

    wanted = set(fixtures)
    chosen = [p for p in PROPERTIES.values() if p.fixture in wanted]
    if names is not None:
        keep = set(names)
        unknown = keep - set(PROPERTIES)
        if unknown:
            raise ValueError(f"unknown conformance properties: {sorted(unknown)}")
        chosen = [p for p in chosen if p.name in keep]
    return chosen


def run_property(prop: Property, session: Session) -> PropertyResult:
    """Run one property; never raises (every outcome is a :class:`PropertyResult`)."""
    t0 = time.perf_counter()
    try:
        prop.fn(session)
        status, detail = "PASS", ""
    except ConformanceFailure as e:
        status, detail = "FAIL", e.render()
    except PropertySkipped as e:
        status, detail = "SKIP", str(e)
    except Exception as e:
        status = "ERROR"
        detail = f"contract: {prop.contract}\nunexpected {type(e).__name__}: {e}\n" + "".join(
            traceback.format_exception(e)[-6:]
        )
    return PropertyResult(
        prop.name, prop.contract, prop.fixture, status, detail, time.perf_counter() - t0
    )


def run_conformance(
    factory: BackendFactory,
    *,
    fixtures: Iterable[str] = ("toy", "smollm2"),
    names: Iterable[str] | None = None,
    slow: bool = False,
    seed: int | None = None,
) -> list[PropertyResult]:
    """Run the suite on the backend ``factory`` makes; one result per selected property.

    Args:
        factory: a backend class or ``factory(tokenizer, vocab_size=V) -> GrammarBackend``.
        fixtures: tokenizers to run on (``"toy"``: exact cases, seconds; ``"smollm2"``: real
            schemas and random draft trees).
        names: only these properties.
        slow: long mode (more random examples, whole data sets).
        seed: random seed for the hypothesis properties (``None``: the same examples each run).
    """
    session = Session(factory, slow=slow, seed=seed)
    return [run_property(p, session) for p in select_properties(fixtures, names)]
