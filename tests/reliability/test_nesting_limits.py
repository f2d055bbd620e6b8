"""Deep inputs (issue 33, item 2): ``max_nesting_depth`` refuses a spec nested past it before
any library call, on every backend, with a typed error naming the limit; raised, a deep spec
still ends in a typed error (never ``RecursionError``, ``ValueError`` or a crash); ordinary
schemas pass; outlines' nested-arrays blow-up is refused before its index is built.

Oracles: the depth of each input by construction, the backend's own compile counter (no
compile ran: the refusal came before any library call), ``jsonschema`` on the outputs, and
the real schemas of the bundled corpora.
"""

from __future__ import annotations

import json
import time
from functools import cache

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_grammar import get_backend
from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.errors import GrammarLimitError, GrammarSpecError, SpecGrammarError
from spec_grammar.limits import grammar_nesting_depth, group_depth, json_nesting_depth
from spec_grammar.nesting import DEFAULT_MAX_NESTING_DEPTH, nesting_depth
from spec_grammar.output_check import check_output
from spec_grammar.specs import Ebnf, JsonSchema, Lark, Regex, ToolCalls

BACKENDS = ("xgrammar", "llguidance", "outlines")
DEEP = 5000


def _objects(depth: int) -> dict:
    """``{"type": "object", "properties": {"a": ...}}`` ``depth`` times around a string:
    JSON depth ``2 * depth + 1``."""
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _ref_chain(links: int) -> dict:
    """``$defs`` d0 -> d1 -> ... -> d<links> (a string), each an object whose property ``x``
    refers to the next: shallow as a document, ``3 * links + 3`` deep expanded (each link an
    object, its ``properties`` and the object holding the ``$ref``; the root and its
    ``$defs`` around the chain)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(links)
    }
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _bare_chain(links: int) -> dict:
    """``$defs`` a0 -> a1 -> ... -> a<links> (a string), each just ``{"$ref": next}``: depth
    ``links + 3`` (llguidance 1.9.1 segfaults at 3,000 links counted as depth 3)."""
    defs: dict = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(links)}
    defs[f"a{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _groups(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


DEEP_SPECS = {
    "schema": lambda d: JsonSchema(_objects(d)),
    "ref_chain": lambda d: JsonSchema(_ref_chain(d // 3)),
    "bare_ref_chain": lambda d: JsonSchema(_bare_chain(d)),
    "regex": lambda d: Regex(_groups(d)),
    "pattern": lambda d: JsonSchema({"type": "string", "pattern": f"^{_groups(d)}$"}),
    "lark": lambda d: Lark(f'start: {"(" * d}"a"{")" * d}\n'),
    "ebnf": lambda d: Ebnf(f'root ::= {"(" * d}"a"{")" * d}\n'),
    "ebnf_chain": lambda d: Ebnf(
        "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(d)) + f'r{d} ::= "b"\n'
    ),
    "lark_chain": lambda d: Lark(
        "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(d)) + f'r{d}: "b"\n'
    ),
    "tool_calls": lambda d: ToolCalls(
        [{"type": "function", "function": {"name": "f", "parameters": _objects(d)}}]
    ),
}


@cache
def _shared(name, tok, max_nesting_depth):
    return get_backend(name, tok, max_nesting_depth=max_nesting_depth)


def _backend(name, tok, max_nesting_depth=DEFAULT_MAX_NESTING_DEPTH):
    """One backend per name and limit for the module (llguidance takes ~3 s to build)."""
    if name != "auto":
        pytest.importorskip({"outlines": "outlines_core"}.get(name, name))
    return _shared(name, tok, max_nesting_depth)


def test_measures_are_exact_and_iterative_at_depth_20000():
    """Each measure returns the depth its input was built with, at a depth whose recursive
    walk would pass Python's recursion limit 20 times over."""
    n = 20_000
    doc: object = 1
    for _ in range(n):
        doc = [doc]
    assert json_nesting_depth(doc) == n
    assert json_nesting_depth(_objects(n)) == 2 * n + 1
    assert group_depth(_groups(n)) == n
    assert group_depth(r"\((a)[(((]") == 1  # escapes and classes hold no group
    assert grammar_nesting_depth(f'start: {"(" * n}"(" /(a)/{")" * n}', "lark") == n + 1
    assert grammar_nesting_depth(f'root ::= {"(" * n}"(" [(]{")" * n} # ((', "ebnf") == n
    assert grammar_nesting_depth(DEEP_SPECS["ebnf_chain"](n).text, "ebnf") == n + 1
    assert grammar_nesting_depth(DEEP_SPECS["lark_chain"](n).text, "lark") == n + 1
    # recursion through a rule being expanded adds nothing: start -> expr -> term (-> expr)
    calc = 'start: expr\nexpr: term ("+" term)*\nterm: "(" expr ")" | NUM\nNUM: /[0-9]+/\n%ignore " "\n'
    assert grammar_nesting_depth(calc, "lark") == 4


def test_recursive_refs_are_finite_and_ref_chains_expand():
    """A schema referring to itself (legitimate recursion) has its document's depth plus one
    expansion at most; a chain of definitions counts expanded."""
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert json_nesting_depth(tree) == 4
    mutual = {
        "$defs": {"a": {"items": {"$ref": "#/$defs/b"}}, "b": {"items": {"$ref": "#/$defs/a"}}},
        "$ref": "#/$defs/a",
    }
    assert json_nesting_depth(mutual) <= 6
    assert json_nesting_depth(_ref_chain(1000)) == 3 * 1000 + 3
    assert json_nesting_depth(_bare_chain(20_000)) == 20_000 + 3
    # a linked list (a definition referring to itself) is as deep as one expansion
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}
    assert json_nesting_depth({"$defs": {"node": node}, "$ref": "#/$defs/node"}) == 5
    assert json_nesting_depth({"const": {"$ref": "#/$defs/x"}, "$defs": {"x": _objects(50)}}) == 103


@pytest.mark.parametrize("kind", list(DEEP_SPECS))
@pytest.mark.parametrize("name", BACKENDS + ("auto",))
def test_deep_spec_is_refused_before_any_library_call(name, kind, tok):
    """Depth 5000 of every kind the backend claims: GrammarLimitError naming the measured
    depth and max_nesting_depth, raised before the compile cache runs a compile (the backend's
    ``num_compiles`` stays 0: no library build started)."""
    backend = _backend(name, tok)
    spec = DEEP_SPECS[kind](DEEP)
    if not getattr(backend.capabilities, spec.kind):
        pytest.skip(f"{name} does not claim {spec.kind}")
    with pytest.raises(GrammarLimitError, match="max_nesting_depth=128") as e:
        backend.compile(spec)
    assert f"nesting depth {nesting_depth(spec)[0]} " in str(e.value)
    assert backend.num_compiles == 0


@pytest.mark.parametrize("depth", [200, DEEP])
@pytest.mark.parametrize("kind", list(DEEP_SPECS))
@pytest.mark.parametrize("name", BACKENDS + ("auto",))
def test_raised_limit_still_gives_typed_errors(name, kind, depth, tok):
    """max_nesting_depth=10**6 lets deep specs through to the compile: each then compiles or
    fails with a SpecGrammarError (the library's own nesting limits, or GrammarLimitError
    for a recursive step, a serializer or the library's known safe depth), never
    RecursionError or ValueError, and the process lives."""
    backend = _backend(name, tok, 10**6)
    spec = DEEP_SPECS[kind](depth)
    if not getattr(backend.capabilities, spec.kind):
        pytest.skip(f"{name} does not claim {spec.kind}")
    try:
        backend.compile(spec)
    except SpecGrammarError:
        pass
    ok = backend.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert backend.matcher(ok).accept_tokens(tok.encode('{"a": 1}', add_special_tokens=False)) > 0


def _corpus():
    for row in jsonschemabench_sample():
        yield f"jsonschemabench/{row['subset']}/{row['id']}", JsonSchema(row["schema"])
    for case in bfcl_cases():
        yield f"bfcl/{case['id']}", ToolCalls(case["tools"])


def test_real_schemas_are_within_the_default():
    """Every schema and tool list of the bundled corpora (84 JSONSchemaBench, 40 BFCL) is
    within the default limit, so the check refuses none of them."""
    depths = {name: nesting_depth(spec)[0] for name, spec in _corpus()}
    assert len(depths) == 124
    assert max(depths.values()) <= DEFAULT_MAX_NESTING_DEPTH // 4, max(
        depths.items(), key=lambda x: x[1]
    )


def test_deep_text_is_checked_without_crashing():
    """The post-check of an output nested 100,000 deep: a violation saying so, not a
    RecursionError; a deep spec read from a JSON string is a GrammarSpecError."""
    text = "[" * 100_000 + "]" * 100_000
    valid, violations = check_output(JsonSchema({"type": "array"}), text)
    assert valid is False and "nests too deeply" in violations[0].message
    valid, _ = check_output(Regex(_groups(DEEP)), "a")
    assert valid in (True, None)
    with pytest.raises(GrammarSpecError, match="nested too deeply"):
        JsonSchema('{"a":' * 100_000 + "1" + "}" * 100_000)


def _nested_arrays(levels: int, max_items: int) -> dict:
    s: dict = {"type": "object", "properties": {"a": {"type": "string"}}}
    for _ in range(levels):
        s = {"type": "array", "maxItems": max_items, "items": s}
    return s


def test_outlines_nested_arrays_blow_up_is_refused_at_once(tok):
    """Arrays of <= 3 items nested 6 deep around an object of one string: outlines-core's
    build grows with states x wide states (several GB, then SIGABRT); refused with
    GrammarLimitError before any index is built. Five levels (334 MB measured) are estimated
    under the limit; the bundled corpora's regexes gain no refusal (their counted repetitions
    never nest: checked in the report of issue 33)."""
    pytest.importorskip("outlines_core")
    from spec_grammar_outlines import DEFAULT_MAX_INDEX_BYTES, estimated_index_bytes

    backend = get_backend("outlines", tok)
    t0 = time.perf_counter()
    with pytest.raises(GrammarLimitError, match="max_index_bytes"):
        backend.compile(JsonSchema(_nested_arrays(6, 3)))
    assert time.perf_counter() - t0 < 5.0
    assert backend.num_compiles == 1  # the refusal is cached like any compile error
    regex, _ = backend._regex_of(JsonSchema(_nested_arrays(5, 3)))
    assert estimated_index_bytes(regex, len(tok)) < DEFAULT_MAX_INDEX_BYTES


def _naive_depth(doc) -> int:
    """The recursive definition, the oracle of :func:`json_nesting_depth` on documents
    without references."""
    if isinstance(doc, dict):
        return 1 + max(map(_naive_depth, doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max(map(_naive_depth, doc), default=0)
    return 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "items", "anyOf", "a", "const"]), inner, max_size=3
        )
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_json_depth_equals_the_recursive_definition(doc):
    """Random JSON documents (no ``$ref``): the iterative measure equals the recursive one."""
    assert json_nesting_depth(doc) == _naive_depth(doc)


def test_the_bare_chain_that_crashed_llguidance_is_refused_by_its_safe_depth(tok):
    """The breaker's sample: 3,000 bare ``$ref`` links segfaulted llguidance 1.9.1 in a
    compile thread while measuring depth 3. It now measures 3,003: past the default limit,
    and with the limit raised, past the library's safe depth (both typed, no compile run)."""
    pytest.importorskip("llguidance")
    spec = JsonSchema(_bare_chain(3000))
    assert nesting_depth(spec)[0] == 3003
    with pytest.raises(GrammarLimitError, match="max_nesting_depth=128"):
        _backend("llguidance", tok).compile(spec)
    raised = _backend("llguidance", tok, 10**6)
    compiles = raised.num_compiles
    with pytest.raises(GrammarLimitError, match="the deepest this backend's library survives"):
        raised.compile(spec)
    assert raised.num_compiles == compiles


# the deepest JSON text each library's parser reads (serde_json in llguidance and outlines-core)
NATIVE_TEXT_DEPTH = {"llguidance": 124, "outlines": 127}


@pytest.mark.parametrize("name", BACKENDS)
def test_the_documented_limit_is_the_one_that_holds(name, tok):
    """Depth exactly ``max_nesting_depth`` (128: an array of 63 nested objects) compiles
    where the library's own parser reads that deep (xgrammar; the recursive steps of the
    compile, the meta-schema check first, refused 127 before) and is a GrammarLimitError
    naming the library's depth where it does not; 129 is refused by the limit on every
    backend. The compiled grammar accepts the one document ``jsonschema`` accepts."""
    backend = _backend(name, tok)
    at_limit = JsonSchema({"type": "array", "items": _objects(63)})
    over = JsonSchema({"type": "array", "items": at_limit.json_schema})
    assert nesting_depth(at_limit)[0] == DEFAULT_MAX_NESTING_DEPTH
    with pytest.raises(GrammarLimitError, match="nesting depth 129 .* max_nesting_depth=128"):
        backend.compile(over)
    if name in NATIVE_TEXT_DEPTH:
        with pytest.raises(GrammarLimitError, match=f"at most {NATIVE_TEXT_DEPTH[name]} deep"):
            backend.compile(at_limit)
        # at the library's own depth it compiles
        deepest = NATIVE_TEXT_DEPTH[name]
        spec = JsonSchema(_objects((deepest - 1) // 2) if deepest % 2 else _arrays(deepest - 1))
        assert nesting_depth(spec)[0] == deepest
        backend.compile(spec)
        return
    compiled = backend.compile(at_limit)
    doc: object = "x"
    for _ in range(63):
        doc = {"a": doc}
    jsonschema.validate([doc], at_limit.json_schema)
    ids = tok.encode(json.dumps([doc]), add_special_tokens=False)
    m = backend.matcher(compiled)
    assert m.accept_tokens(ids) == len(ids)
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()


def _arrays(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s
