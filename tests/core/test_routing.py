"""The ``auto`` backend (:mod:`spec_grammar.routing`): routing by the adapters' declarations
(checked against the declarations themselves, :func:`unenforced_keywords`), then by measured
cost; the chosen backend's matcher is the oracle of auto's (fresh-matcher replay), and the
name reaches every door through the registry."""

from __future__ import annotations

import json

import pytest
import torch

from spec_grammar import get_backend
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import BackendNotFoundError, GrammarCompileError, UnsupportedGrammarError
from spec_grammar.json_schema.strict import KeywordSupport, unenforced_keywords
from spec_grammar.registry import check_backend_name, load_backend_class
from spec_grammar.routing import AutoBackend, rank
from spec_grammar.specs import Ebnf, JsonSchema, Regex, ToolCalls

for _library in ("xgrammar", "llguidance", "outlines_core"):  # routing among all three
    pytest.importorskip(_library, exc_type=ImportError)
XGR = load_backend_class("xgrammar")
LLG = load_backend_class("llguidance")
OUT = load_backend_class("outlines")
BUILT_IN = {"xgrammar": XGR, "llguidance": LLG, "outlines": OUT}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"type": "object", "minProperties": 1},
        {"type": "array", "uniqueItems": True},
        {"type": "string", "format": "date"},
    ],
)
def test_first_route_leaves_the_fewest_keywords_unenforced(schema):
    routes = rank(JsonSchema(schema), BUILT_IN)
    counts = {
        n: len(unenforced_keywords(schema, c.json_schema_support)) for n, c in BUILT_IN.items()
    }
    assert len(routes[0].unenforced) == min(counts.values())
    assert [len(r.unenforced) for r in routes] == sorted(len(r.unenforced) for r in routes)


def test_kinds_route_to_backends_that_claim_them_and_cost_breaks_ties():
    assert [r.name for r in rank(Ebnf('root ::= "a"'), BUILT_IN)] == ["xgrammar", "llguidance"]
    tied = rank(JsonSchema({"type": "string"}), BUILT_IN)
    assert [r.cost_ms for r in tied] == sorted(r.cost_ms for r in tied)


def test_a_third_party_adapter_takes_part_through_its_declarations():
    class Complete(XGR):  # declares uniqueItems enforced: it wins that schema, unmeasured
        name = "complete"
        json_schema_support = KeywordSupport()

    routes = rank(
        JsonSchema({"type": "array", "uniqueItems": True}), {**BUILT_IN, "complete": Complete}
    )
    assert routes[0].name == "complete" and routes[0].cost_ms == float("inf")
    assert "enforces every keyword" in routes[0].reason(routes)


def test_auto_is_a_registered_name():
    assert load_backend_class("auto") is AutoBackend
    check_backend_name("auto")
    with pytest.raises(BackendNotFoundError, match="registered: auto"):
        check_backend_name("nope")


def test_auto_compiles_on_its_choice_and_its_matcher_replays_as_the_choices(tok):
    auto = get_backend("auto", tok)
    spec = JsonSchema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "minProperties": 1}
    )
    compiled = auto.compile(spec)
    assert compiled.backend_name == rank(spec)[0].name == "llguidance"
    assert compiled.route.startswith("llguidance: enforces every keyword")
    ids = tok.encode('{"n": 12}', add_special_tokens=False)
    m = auto.matcher(compiled)
    oracle = auto.child("llguidance")
    fresh = oracle.matcher(oracle.compile(spec))
    assert m.accept_tokens(ids) == fresh.accept_tokens(ids) > 0
    rows = allocate_token_bitmask(2, oracle.vocab_size)
    m.fill_next_token_bitmask(rows, 0)
    fresh.fill_next_token_bitmask(rows, 1)
    assert torch.equal(rows[0], rows[1])
    assert auto.compile(Regex("[a-z]+")).backend_name == "xgrammar"


def test_auto_fails_once_for_what_every_backend_refuses(tok):
    auto = get_backend("auto", tok)
    with pytest.raises(GrammarCompileError, match=r"\[auto\] invalid JSON Schema"):
        auto.compile(JsonSchema({"type": "strng"}))
    with pytest.raises(UnsupportedGrammarError, match="no registered backend enforces every"):
        auto.compile(JsonSchema({"type": "array", "uniqueItems": True}, strict=True))
    assert not auto._children  # refused before any backend was built
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert auto.compile(ToolCalls(tools, strict=True)).spec.strict


def test_auto_passes_the_conformance_properties_it_routes_through(capsys):
    """auto is a backend like the others: the toy-tokenizer tree, rollback/fork and mask
    properties pass through its routing (the whole quick suite passes: ``spec-grammar
    conformance --backend auto --quick``)."""
    from spec_grammar.cli import main

    props = ["toy_random_tree_rows", "toy_T1_rollback_fork_roundtrip", "toy_T3_tree_rows"]
    argv = ["conformance", "--backend", "auto", "--quick", "--json"]
    rc = main(argv + [a for p in props for a in ("--property", p)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"], report
    assert sorted(r["name"] for r in report["results"] if r["status"] == "PASS") == sorted(props)


def test_an_oversized_spec_is_left_to_the_compile_size_check(tok):
    """The CLI's pre-check does not run the meta-schema over a spec past the default
    max_grammar_bytes (150,000 properties took 54 s there): the compile refuses it first."""
    from spec_grammar.limits import DEFAULT_MAX_GRAMMAR_BYTES
    from spec_grammar.precheck import early_refusal

    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200_000)}}
    spec = JsonSchema(big)
    assert len(spec.cache_key()) > DEFAULT_MAX_GRAMMAR_BYTES
    assert early_refusal(spec, "auto") is None
    with pytest.raises(GrammarCompileError, match="max_grammar_bytes"):
        get_backend("llguidance", tok).compile(spec)
