"""The backends' declarations read from their source (``backend_info.declarations``) equal the
imported classes' attributes (the oracle), so the CLI's torch-free refusals
(``spec_grammar.precheck``) decide as the compile would."""

from __future__ import annotations

import json

import pytest

from spec_grammar.backend_info import declarations
from spec_grammar.errors import SpecGrammarError
from spec_grammar.precheck import early_refusal
from spec_grammar.ranking import registered_classes
from spec_grammar.specs import Ebnf, JsonSchema, Regex, ToolCalls

pytestmark = pytest.mark.unit

UNIQUE = {"type": "array", "uniqueItems": True}
BOUNDED = {"type": "integer", "minimum": 3}


def test_declarations_equal_the_imported_classes():
    declared = declarations()
    assert declared is not None
    classes = {n: c for n, c in registered_classes().items() if isinstance(c, type)}
    assert declared.keys() == classes.keys()
    for name, d in declared.items():
        cls = classes[name]
        for attr in ("capabilities", "json_schema_support", "output_limits", "schema_caps"):
            assert getattr(d, attr) == getattr(cls, attr), (name, attr)


SPECS = [
    JsonSchema(UNIQUE, strict=True),
    JsonSchema(BOUNDED, strict=True),
    JsonSchema(BOUNDED),
    JsonSchema({"type": "strng"}),
    Regex("a+"),
    Ebnf('root ::= "a"'),
    ToolCalls(
        tools=[{"type": "function", "function": {"name": "f", "parameters": BOUNDED}}],
        strict=True,
    ),
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines", "auto"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind + json.dumps(s.model_dump())[:40])
def test_an_early_refusal_is_the_compiles_own(backend, spec, tok):
    """Oracle: the real compile of the same spec: a refusal exactly where the compile
    refuses, with its message (none of these specs is refused by a library alone)."""
    from spec_grammar.worker.api import precompile

    early = early_refusal(spec, backend)
    try:
        precompile(spec, grammar_backend=backend)
        compiled = None
    except SpecGrammarError as e:
        compiled = e
    assert (early is None) == (compiled is None), (early, compiled)
    if early is not None:
        assert str(early) == str(compiled) and type(early) is type(compiled)
