"""The backend-conformance suite: properties every :class:`~spec_grammar.SpecGrammar` backend
must satisfy, runnable on ANY backend.

- ``spec-grammar conformance --backend NAME|module:Class`` (see :mod:`spec_grammar.cli.conformance`);
- pytest: ``pytest --spec-grammar-backend NAME`` (plugin :mod:`spec_grammar.testing.pytest_plugin`);
- Python: ``run_conformance(BackendClass)``.

Properties are plain functions ``fn(session)`` registered in :data:`PROPERTIES`; a failure
names the contract, the input, and the expected and actual allowed sets (ids and text).
"""

from .core import PROPERTIES, BackendFactory, ConformanceFailure, Property, PropertySkipped, Session
from .fixtures import fixture_tokenizer, toy_tokenizer
from .suite import (
    PropertyResult,
    resolve_factory,
    run_conformance,
    run_property,
    select_properties,
)

__all__ = [
    "PROPERTIES",
    "BackendFactory",
    "ConformanceFailure",
    "Property",
    "PropertySkipped",
    "Session",
    "fixture_tokenizer",
    "toy_tokenizer",
    "PropertyResult",
    "resolve_factory",
    "run_conformance",
    "run_property",
    "select_properties",
]
