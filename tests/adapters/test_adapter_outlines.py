"""The outlines-core adapter against independent oracles, on the real SmolLM2 tokenizer.

Oracles: Python's ``regex`` module with partial matching (a token is allowed iff the text so
far plus its bytes can still become a full match; the stop token iff the text is a full
match), fresh-matcher replay of every path, the generic reference tree fill
(:func:`spec_grammar.traverse.fill_tree_bitmask_dfs`) and mask-based forced tokens
(:func:`spec_grammar.traverse.forced_tokens_by_mask`), ``jsonschema`` for documents.
"""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("outlines_core")

from outlines_core.json_schema import build_regex_from_schema  # noqa: E402
from spec_grammar_outlines import OutlinesBackend, OutlinesMatcher  # noqa: E402

from spec_grammar import datasets  # noqa: E402
from spec_grammar.bitmask import allocate_token_bitmask  # noqa: E402
from spec_grammar.errors import (  # noqa: E402
    GrammarCompileError,
    GrammarStateError,
    UnsupportedGrammarError,
)
from spec_grammar.registry import get_backend  # noqa: E402
from spec_grammar.specs import Ebnf, JsonSchema, Lark, Regex, ToolCalls  # noqa: E402
from spec_grammar.traverse import fill_tree_bitmask_dfs, forced_tokens_by_mask  # noqa: E402
from spec_grammar.tree import DraftTree  # noqa: E402

PAD = 77  # extra logits columns of the padded backend (not a multiple of 32 on purpose)
INVOICE = next(
    r["schema"]
    for r in datasets.jsonschemabench_sample("Glaiveai2K")
    if r["id"] == "generate_invoice_2138db6b"
)
# Keys in the schema's property order: outlines emits properties in that order.
INVOICE_DOC = {
    "customer_name": "Ann Lee",
    "items": [
        {"name": "pen", "price": 1.5, "quantity": 2},
        {"name": "ink", "price": 0.25, "quantity": 10},
    ],
    "order_total": 5.5,
}
SHORT_REGEX = r"[a-c]{1,4}( [0-9]{1,2})?"


@pytest.fixture(scope="module")
def backend(tok):
    return get_backend("outlines", tok)


@pytest.fixture(scope="module")
def padded(tok):
    return OutlinesBackend(tok, vocab_size=len(tok) + PAD)


@pytest.fixture(scope="module")
def invoice(padded):
    return padded.compile(JsonSchema(INVOICE))


def row_of(m: OutlinesMatcher) -> np.ndarray:
    bm = allocate_token_bitmask(1, m.info.vocab_size)
    m.fill_next_token_bitmask(bm, 0)
    return bm[0].numpy().copy()


def ids_of(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def replay(be, compiled, tokens) -> OutlinesMatcher:
    m = be.matcher(compiled)
    assert m.accept_tokens(tokens) == len(tokens)
    return m


def random_walk(m, rng: random.Random, steps: int, eos_bias: float = 0.3) -> list[int]:
    """Accept up to ``steps`` tokens drawn from the current row (the stop token with
    probability ``eos_bias`` when allowed); stops at termination."""
    taken = []
    for _ in range(steps):
        if m.is_terminated():
            break
        allowed = ids_of(row_of(m))
        if len(allowed) == 0:
            break
        stops = [t for t in allowed if m.is_stop_token(t)]
        t = stops[0] if stops and rng.random() < eos_bias else int(rng.choice(list(allowed)))
        assert m.accept_token(t)
        taken.append(t)
    return taken


@functools.cache
def _text_tokens(info) -> tuple[list[int], list[str], list[int]]:
    """(ids of tokens whose bytes are valid UTF-8, their text, ids that must never be allowed)."""
    ids, texts, never = [], [], []
    for t, b in enumerate(info.token_bytes):
        if t in info.stop_token_ids:
            continue
        if t in info.special_token_ids or not b:
            never.append(t)
            continue
        try:
            texts.append(b.decode("utf-8"))
            ids.append(t)
        except UnicodeDecodeError:
            pass
    return ids, texts, never


def regex_oracle_check(m: OutlinesMatcher, pattern: str, prefix: bytes) -> None:
    """Every token whose text decodes is allowed iff the pattern can still match; the stop
    token iff the text matches in full; special ids and ids past the tokenizer never.
    (Tokens holding a partial UTF-8 sequence are not checked here.)"""
    p = regex.compile(pattern)
    info = m.info
    allowed = set(ids_of(row_of(m)).tolist())
    text = prefix.decode("utf-8")
    for s in info.stop_token_ids:
        assert (s in allowed) == bool(p.fullmatch(text)), (text, s)
    ids, texts, never = _text_tokens(info)
    assert not allowed & set(never)
    for t, piece in zip(ids, texts):
        assert (t in allowed) == bool(p.fullmatch(text + piece, partial=True)), (text, piece)
    assert max(allowed, default=0) < info.tokenizer_vocab_size


# -- compile ----------------------------------------------------------------------------------


def test_registered_and_capabilities_honest(backend):
    caps = backend.capabilities
    assert backend.name == "outlines" and isinstance(backend, OutlinesBackend)
    assert caps.json_schema and caps.regex and caps.tool_calls
    assert not (caps.ebnf or caps.lark)


@pytest.mark.parametrize(
    "spec",
    [Ebnf('root ::= "a"'), Lark('start: "a"')],
)
def test_cfg_unsupported(backend, spec):
    with pytest.raises(UnsupportedGrammarError, match=spec.kind):
        backend.compile(spec)


@pytest.mark.parametrize(
    "spec, error",
    [
        (Regex("(ab"), GrammarCompileError),
        (JsonSchema(False), GrammarCompileError),
        (JsonSchema({"type": "string", "format": "hostname"}), UnsupportedGrammarError),
    ],
)
def test_bad_grammars_raise_typed_errors(backend, spec, error):
    with pytest.raises(error) as e:
        backend.compile(spec)
    assert "[outlines]" in str(e.value)


# -- masks against the regex oracle -----------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, text", [(SHORT_REGEX, "abc 42"), (r"\d{1,3}(\.\d{1,2})?", "7.25")]
)
def test_regex_masks_match_partial_regex_oracle(backend, tok, pattern, text):
    compiled = backend.compile(Regex(pattern))
    ids = tok.encode(text)
    m = backend.matcher(compiled)
    for i in range(len(ids) + 1):
        regex_oracle_check(m, pattern, tok.decode(ids[:i]).encode())
        if i < len(ids):
            assert m.accept_token(ids[i])


def test_top_level_number_schema_continues_after_a_complete_number(backend, tok):
    # outlines-core 0.2.14 alone drops "." after "12" (a token leaving a final state).
    schema = {"type": "number"}
    pattern = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    compiled = backend.compile(JsonSchema(schema, whitespace="compact"))
    ids = tok.encode("12.5e+3")
    m = backend.matcher(compiled)
    for i in range(len(ids) + 1):
        regex_oracle_check(m, pattern, tok.decode(ids[:i]).encode())
        if i < len(ids):
            assert m.accept_token(ids[i])
    assert m.accept_token(tok.eos_token_id)
    assert json.loads(tok.decode(ids)) == 12.5e3


def test_sentinel_bytes_allowed_only_where_the_grammar_allows_them(backend, tok):
    char = "\U0010fffd"  # the adapter's end marker, spelled with byte tokens below
    byte_ids = [backend.tokenizer_info.token_bytes.index(bytes([b])) for b in char.encode()]
    # After "a" the grammar may end or continue with " b": none of the byte tokens fit.
    m = replay(backend, backend.compile(Regex(r"a( b)?")), tok.encode("a"))
    assert not set(byte_ids) & set(ids_of(row_of(m)).tolist())
    assert m.validate_tokens(byte_ids) == 0
    tree = DraftTree.chain(0, byte_ids)
    assert m.fill_tree_bitmask(
        tree, allocate_token_bitmask(len(tree), backend.vocab_size)
    ).tolist() == [True] + [False] * len(byte_ids)
    # Inside a string the same code point is ordinary text.
    pattern = r'"[^"]*"'
    m = backend.matcher(backend.compile(Regex(pattern)))
    text = tok.encode('"')
    assert m.accept_tokens(text) == 1
    for t in byte_ids:
        assert t in ids_of(row_of(m))
        assert m.accept_token(t)
    assert m.accept_tokens(tok.encode('"')) == 1
    assert regex.fullmatch(pattern, '"' + char + '"')
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()


def test_json_masks_match_schema_regex_and_document_validates(padded, invoice, tok):
    text = json.dumps(INVOICE_DOC)
    jsonschema.validate(INVOICE_DOC, INVOICE)  # guard: the input is valid
    pattern = build_regex_from_schema(json.dumps(INVOICE), whitespace_pattern=r"[ ]?")
    ids = tok.encode(text)
    m = padded.matcher(invoice)
    checked = set(range(0, len(ids) + 1, 20)) | {len(ids) - 1, len(ids)}
    for i in range(len(ids) + 1):
        if i in checked:
            regex_oracle_check(m, pattern, tok.decode(ids[:i]).encode())
        if i < len(ids):
            assert m.accept_token(ids[i]), (i, tok.decode(ids[: i + 1]))
    eos = tok.eos_token_id
    assert m.accept_token(eos) and m.is_terminated()
    jsonschema.validate(json.loads(tok.decode(ids)), INVOICE)


def test_whitespace_policies(backend, tok):
    compact, spaced = (
        backend.compile(JsonSchema(INVOICE, whitespace=w)) for w in ("compact", "spaced")
    )
    dense = tok.encode(json.dumps(INVOICE_DOC, separators=(",", ":")))
    pretty = tok.encode(json.dumps(INVOICE_DOC))
    assert backend.matcher(compact).validate_tokens(dense) == len(dense)
    assert backend.matcher(compact).validate_tokens(pretty) < len(pretty)
    # `[ ]?` is the closest outlines gets to "spaced": both forms are accepted.
    assert backend.matcher(spaced).validate_tokens(pretty) == len(pretty)
    assert backend.matcher(spaced).validate_tokens(dense) == len(dense)


def test_padding_and_special_ids_never_allowed(padded, invoice, tok):
    n_tok = len(tok)
    assert padded.vocab_size == n_tok + PAD
    m = padded.matcher(invoice)
    assert m.accept_token(n_tok + 3) is False
    assert m.validate_tokens([n_tok + 3]) == 0
    special = next(t for t in sorted(m.info.special_token_ids) if not m.is_stop_token(t))
    assert m.accept_token(special) is False
    rng = random.Random(0)
    for _ in range(40):
        ids = ids_of(row_of(m))
        assert ids.max() < n_tok
        assert not (set(ids.tolist()) & (m.info.special_token_ids - set(m.info.stop_token_ids)))
        if not random_walk(m, rng, 1, eos_bias=0.0):
            break


# -- accept / rollback / fork -----------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 12))
def test_accept_rollback_fork_exact_across_eos(backend, seed, steps):
    compiled = backend.compile(Regex(SHORT_REGEX))
    rng = random.Random(seed)
    m = backend.matcher(compiled)
    rows = [row_of(m)]
    path: list[int] = []
    for _ in range(steps):
        if m.is_terminated():
            break
        t = random_walk(m, rng, 1, eos_bias=0.4)
        if not t:
            break
        path += t
        rows.append(None if m.is_terminated() else row_of(m))
    assert m.num_accepted == len(path)
    if m.is_terminated():
        with pytest.raises(GrammarStateError):
            row_of(m)
        assert m.accept_token(path[-1]) is False and m.validate_tokens([path[-1]]) == 0
        assert m.forced_tokens() == []
    # Fork anywhere: the fork replays like a fresh matcher and is independent.
    k = rng.randint(0, len(path))
    m.rollback(k)
    assert m.num_accepted == len(path) - k
    assert m.is_terminated() == (k == 0 and rows[-1] is None)
    if m.is_terminated():
        return
    np.testing.assert_array_equal(row_of(m), rows[len(path) - k])
    f = m.fork()
    extra = random_walk(f, rng, 3, eos_bias=0.5)
    np.testing.assert_array_equal(row_of(m), rows[len(path) - k])
    g = replay(backend, compiled, path[: len(path) - k] + extra)
    assert f.is_terminated() == g.is_terminated()
    if not f.is_terminated():
        np.testing.assert_array_equal(row_of(f), row_of(g))
    # Re-accepting the undone tokens restores every recorded state, termination included.
    assert m.accept_tokens(path[len(path) - k :]) == k
    assert (rows[-1] is None) == m.is_terminated()


def test_refused_token_is_a_no_op_and_validate_does_not_mutate(padded, invoice, tok):
    ids = tok.encode(json.dumps(INVOICE_DOC))
    m = replay(padded, invoice, ids[:20])
    before = row_of(m)
    refused = int(np.setdiff1d(np.arange(len(tok)), ids_of(before))[0])
    assert m.accept_token(refused) is False
    assert m.num_accepted == 20
    np.testing.assert_array_equal(row_of(m), before)
    bad_chain = ids[20:26] + [refused] + ids[26:30]
    assert m.validate_tokens(bad_chain) == 6
    assert m.validate_tokens(ids[20:] + [tok.eos_token_id, ids[0]]) == len(ids) - 20 + 1
    assert m.num_accepted == 20 and not m.is_terminated()
    np.testing.assert_array_equal(row_of(m), before)
    assert m.accept_tokens(bad_chain) == 6
    assert m.num_accepted == 26


def test_rollback_bound_and_long_history(tok):
    be = OutlinesBackend(tok, max_rollback_tokens=4)
    compiled = be.compile(Regex(r"[a-z ]*"))
    m = be.matcher(compiled)
    word = tok.encode(" hello")
    for _ in range(30):
        assert m.accept_tokens(word) == len(word)
    m.accept_tokens(tok.encode(" ab"))
    with pytest.raises(GrammarStateError):
        m.rollback(5)
    m.rollback(4)
    np.testing.assert_array_equal(
        row_of(m), row_of(replay(be, compiled, (word * 30)[: m.num_accepted]))
    )
    assert m.history_length <= 2 * (be.max_rollback_tokens + 1)


# -- stop tokens and forced tokens ------------------------------------------------------------


def test_eos_exactly_at_final_states_and_forced_tokens(backend, tok):
    pattern = r"12(3|45)?x[a-z]{1,2}"
    compiled = backend.compile(Regex(pattern))
    p = regex.compile(pattern)
    m = backend.matcher(compiled)
    forced = m.forced_tokens()
    assert tok.decode(forced) == "12"  # SmolLM2 has one token per digit: only "1" then "2" fit
    assert forced == forced_tokens_by_mask(m)
    eos = tok.eos_token_id
    for text in ["12", "123", "1245x", "12x", "12xab", "123xq"]:
        ids = tok.encode(text)
        m = replay(backend, compiled, ids)
        full = bool(p.fullmatch(text))
        assert (eos in ids_of(row_of(m))) == full
        assert m.validate_tokens([eos]) == int(full)
        assert m.forced_tokens() == forced_tokens_by_mask(m)
        if full:  # the stop token is an alternative: nothing is forced at a final state
            assert m.forced_tokens() == []
    m = replay(backend, compiled, tok.encode("12"))
    assert m.accept_token(eos) is False and not m.is_terminated()


def test_forced_tokens_along_json_document(padded, invoice, tok):
    ids = tok.encode(json.dumps(INVOICE_DOC))
    m = padded.matcher(invoice)
    for t in ids:
        forced = m.forced_tokens()
        assert forced == forced_tokens_by_mask(m)
        assert m.validate_tokens(forced) == len(forced)
        assert m.accept_token(t)


# -- tree fill --------------------------------------------------------------------------------


@settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data())
def test_tree_rows_equal_fresh_replay(padded, invoice, tok, data):
    doc_ids = tok.encode(json.dumps(INVOICE_DOC))
    n_tok, eos = len(tok), tok.eos_token_id
    root = data.draw(st.integers(0, len(doc_ids)), label="root position")
    prefix = doc_ids[:root]
    m = replay(padded, invoice, prefix)
    n = data.draw(st.integers(1, 16), label="nodes")
    tokens, parents = [prefix[-1] if prefix else 0], [-1]
    paths: list[list[int]] = [[]]  # root..node tokens
    for i in range(1, n):
        parent = data.draw(st.integers(0, i - 1), label="parent")
        kind = data.draw(
            st.sampled_from(["allowed", "allowed", "allowed", "any", "eos", "pad", "neg"])
        )
        ppath = paths[parent]
        probe = padded.matcher(invoice)
        reachable = probe.validate_tokens(prefix + ppath) == root + len(ppath)
        if reachable:
            probe.accept_tokens(prefix + ppath)
        if kind == "allowed" and reachable and not probe.is_terminated():
            t = data.draw(st.sampled_from(ids_of(row_of(probe)).tolist()))
        else:
            fixed = {"eos": eos, "pad": n_tok + PAD - 1, "neg": -1}
            t = fixed[kind] if kind in fixed else data.draw(st.integers(0, n_tok - 1))
        tokens.append(t)
        parents.append(parent)
        paths.append(ppath + [t])
    tree = DraftTree.from_parents(tokens, parents)
    state_before = row_of(m), m.num_accepted

    bm = allocate_token_bitmask(n + 2, padded.vocab_size)
    valid = m.fill_tree_bitmask(tree, bm, row_offset=1)
    rows = bm.numpy()[1 : n + 1]
    np.testing.assert_array_equal(bm.numpy()[[0, n + 1]], -1)  # rows outside the tree untouched

    # Oracle 1: fresh-matcher replay of every root..node path.
    for i in range(n):
        path = paths[i]
        fresh = padded.matcher(invoice)
        # validate_tokens ends the prefix at -1 / out-of-range ids instead of raising.
        ok = fresh.validate_tokens(prefix + path) == root + len(path)
        assert bool(valid[i]) == ok, (i, path)
        if ok:
            fresh.accept_tokens(prefix + path)
        if ok and not fresh.is_terminated():
            np.testing.assert_array_equal(rows[i], row_of(fresh))
        else:
            assert not rows[i].any()
    # Oracle 2: the generic accept/fill/rollback DFS gives bit-identical rows.
    ref = allocate_token_bitmask(n, padded.vocab_size)
    fork = m.fork()
    ref_valid = fill_tree_bitmask_dfs(fork, tree, ref)
    assert valid.tolist() == ref_valid.tolist()
    np.testing.assert_array_equal(rows, ref.numpy())
    # The matcher is exactly as before.
    np.testing.assert_array_equal(row_of(m), state_before[0])
    assert m.num_accepted == state_before[1]


def test_tree_fill_on_terminated_matcher_raises(backend, tok):
    compiled = backend.compile(Regex("a"))
    m = replay(backend, compiled, tok.encode("a") + [tok.eos_token_id])
    with pytest.raises(GrammarStateError):
        m.fill_tree_bitmask(DraftTree.chain(0, [1]), allocate_token_bitmask(2, backend.vocab_size))


# -- mask cache -------------------------------------------------------------------------------


def test_mask_cache_is_bounded_and_rows_stay_exact(tok, padded, invoice):
    row_bytes = 4 * padded.tokenizer_info.bitmask_width
    small = OutlinesBackend(tok, vocab_size=len(tok) + PAD, mask_cache_bytes=3 * row_bytes)
    compiled = small.compile(JsonSchema(INVOICE))
    assert compiled.native.max_cached_states == 3
    ids = tok.encode(json.dumps(INVOICE_DOC))
    m_small, m_big = small.matcher(compiled), padded.matcher(invoice)
    for t in ids:
        np.testing.assert_array_equal(row_of(m_small), row_of(m_big))
        assert compiled.native.num_cached_states <= 3
        assert m_small.accept_token(t) and m_big.accept_token(t)
    builds = compiled.native.row_builds
    assert builds > 3  # rows were evicted and rebuilt, not kept
    row_of(m_small)
    row_of(m_small)
    assert compiled.native.row_builds == builds + 1  # a repeated state is a cache hit


def test_tool_call_document_accepted(backend, tok):
    case = datasets.bfcl_cases()[0]
    (truth,) = case["bfcl_ground_truth"]
    ((name, options),) = truth.items()
    params = case["tools"][0]["function"]["parameters"]["properties"]
    args = {k: options[k][0] for k in params if k in options and options[k][0] != ""}
    doc = [{"name": name, "arguments": args}]
    spec = ToolCalls(case["tools"], whitespace="compact")
    jsonschema.validate(doc, spec.to_json_schema().json_schema)  # guard: the input is valid
    ids = tok.encode(json.dumps(doc, separators=(",", ":")))
    m = backend.matcher(backend.compile(spec))
    assert m.accept_tokens(ids) == len(ids)
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()


def test_compile_cache_keeps_few_indexes_by_default(tok):
    """An outlines index can take gigabytes: the backend keeps DEFAULT_COMPILE_CACHE_SIZE
    compiled grammars, not the protocol's 256; a caller's own size still wins."""
    from spec_grammar_outlines import DEFAULT_COMPILE_CACHE_SIZE

    b = OutlinesBackend(tok)
    specs = [Regex(f"a{{{i}}}") for i in range(1, DEFAULT_COMPILE_CACHE_SIZE + 2)]
    for spec in specs:
        b.compile(spec)
    b.compile(specs[-1])  # the newest: still cached
    assert b.num_compiles == len(specs)
    b.compile(specs[0])  # the oldest was evicted
    assert b.num_compiles == len(specs) + 1
    big = OutlinesBackend(tok, compile_cache_size=64)
    for spec in specs + specs[:1]:
        big.compile(spec)
    assert big.num_compiles == len(specs)
