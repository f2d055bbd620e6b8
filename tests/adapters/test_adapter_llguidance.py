"""The llguidance adapter against oracles: fresh-matcher replay, llguidance's own parser and
``jsonschema``, on the real SmolLM2 tokenizer with a padded logits width."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

from spec_grammar_llguidance import LLGuidanceBackend, LLGuidanceMatcher
from spec_grammar_llguidance.tree_walk import fill_trees

from spec_grammar.bitmask import allocate_token_bitmask, clear_padding_bits
from spec_grammar.datasets import bfcl_cases, jsonschemabench_sample
from spec_grammar.errors import (
    GrammarCompileError,
    GrammarStateError,
    InvalidTokenError,
    UnsupportedGrammarError,
)
from spec_grammar.protocol import GrammarBackend
from spec_grammar.registry import get_backend
from spec_grammar.specs import Ebnf, JsonSchema, Lark, Regex, ToolCalls
from spec_grammar.traverse import fill_tree_bitmask_dfs
from spec_grammar.tree import DraftTree

PAD = 64  # logits columns past the tokenizer, as a padded lm_head has
SCHEMA_ID = (
    "o19071"  # Github_easy: required keys, an array of objects, an int enum, an optional key
)
INSTANCE = {
    "user_id": "u-42",
    "events": [{"type": 3, "show_id": "s 1", "time": 12.5}, {"type": 1}],
    "is_test": 0,
    "cid": "abc",
}


@pytest.fixture(scope="module")
def backend(tok):
    return get_backend("llguidance", tok, vocab_size=len(tok) + PAD)


@pytest.fixture(scope="module")
def par_backend(tok):
    """A backend whose many-request tree fill runs on the parallel executor."""
    return LLGuidanceBackend(tok, vocab_size=len(tok) + PAD, num_threads=2)


@pytest.fixture(scope="module")
def schema():
    (row,) = [r for r in jsonschemabench_sample("Github_easy") if r["id"] == SCHEMA_ID]
    jsonschema.validate(INSTANCE, row["schema"])
    return row["schema"]


@pytest.fixture(scope="module")
def compiled(backend, schema):
    return backend.compile(JsonSchema(schema))


@pytest.fixture(scope="module")
def ids(tok, backend, compiled):
    """Tokens of ``json.dumps(INSTANCE)`` (no EOS); the grammar accepts all of them."""
    out = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)
    assert backend.matcher(compiled).validate_tokens(out) == len(out)
    return out


@pytest.fixture(scope="module")
def eos(tok):
    return tok.eos_token_id


def row_of(matcher) -> torch.Tensor:
    bm = allocate_token_bitmask(1, matcher.info.vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    return bm[0].clone()


def fresh_row(backend, compiled, tokens) -> torch.Tensor | None:
    """Oracle: the row after ``tokens`` on a fresh matcher (None once terminated)."""
    m = backend.matcher(compiled)
    assert m.accept_tokens(tokens) == len(tokens)
    return None if m.is_terminated() else row_of(m)


def allowed_token_ids(row: torch.Tensor) -> list[int]:
    """Token ids set in one ``(W,)`` int32 row (numpy: this runs on ~50k-token rows often)."""
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")).tolist()


def bit(row: torch.Tensor, t: int) -> bool:
    return bool((int(row[t >> 5]) >> (t & 31)) & 1)


def test_registered_with_honest_capabilities(backend):
    assert isinstance(backend, LLGuidanceBackend)
    assert isinstance(backend.matcher(backend.compile(Regex("a+"))), LLGuidanceMatcher)
    caps = backend.capabilities
    assert caps.json_schema and caps.regex and caps.ebnf and caps.lark and caps.tool_calls
    # many requests' trees are filled together through llguidance's LLExecutor
    assert type(backend).fill_tree_bitmasks is not GrammarBackend.fill_tree_bitmasks
    assert backend.library_version().startswith("1.")


def test_plain_tokenizers_tokenizer_gives_the_same_backend(tok, backend, schema, ids, eos):
    """A ``tokenizers.Tokenizer`` (what a user without transformers has) with explicit stop ids
    builds the same backend as the transformers tokenizer around it: same tokenizer info,
    same rows along a document, same termination."""
    plain = get_backend(
        "llguidance", tok.backend_tokenizer, vocab_size=len(tok) + PAD, stop_token_ids=[eos]
    )
    a, b = backend.tokenizer_info, plain.tokenizer_info
    assert (b.vocab_size, b.tokenizer_vocab_size, b.stop_token_ids, b.special_token_ids) == (
        a.vocab_size,
        a.tokenizer_vocab_size,
        a.stop_token_ids,
        a.special_token_ids,
    )
    assert b.token_bytes == a.token_bytes
    ma = backend.matcher(backend.compile(JsonSchema(schema)))
    mb = plain.matcher(plain.compile(JsonSchema(schema)))
    for t in ids:
        assert torch.equal(row_of(ma), row_of(mb))
        assert ma.accept_token(t) and mb.accept_token(t)
    assert torch.equal(row_of(ma), row_of(mb))
    assert mb.accept_token(eos) and mb.is_terminated()


def test_tokenizer_from_json_gives_the_masks_llguidance_hf_gave(tok, backend, schema, ids, eos):
    """Oracle for the LLTokenizer built from the tokenizer's JSON: the one
    ``llguidance.hf.from_tokenizer`` builds (what the adapter used before), the same rows along
    a document; and building it leaves the caller's tokenizer as it was (padding kept)."""
    import llguidance.hf
    from spec_grammar_llguidance.vocab import tokenizer_json

    width = len(tok) + PAD
    old = LLGuidanceBackend(tok, vocab_size=width)
    old._llg_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=width, eos_token=[eos])
    ma = backend.matcher(backend.compile(JsonSchema(schema)))
    mb = old.matcher(old.compile(JsonSchema(schema)))
    for t in ids:
        assert torch.equal(row_of(ma), row_of(mb))
        assert ma.accept_token(t) and mb.accept_token(t)
    assert torch.equal(row_of(ma), row_of(mb))
    rust = tok.backend_tokenizer
    rust.enable_padding(length=7)
    try:
        assert json.loads(tokenizer_json(tok))["padding"] is None
        assert rust.padding is not None and rust.padding["length"] == 7
    finally:
        rust.no_padding()


def test_accept_rollback_fork_exact_across_eos(backend, compiled, ids, eos):
    m = backend.matcher(compiled)
    assert m.accept_tokens(ids + [eos, ids[0]]) == len(ids) + 1
    assert m.is_terminated()
    assert not m.accept_token(eos)
    with pytest.raises(GrammarStateError):
        row_of(m)
    m.rollback(1)  # un-terminates: only the stop token may follow the final "}"
    assert not m.is_terminated()
    assert allowed_token_ids(row_of(m)) == [eos]
    assert torch.equal(row_of(m), fresh_row(backend, compiled, ids))
    for k in (1, 3, 7, len(ids) - 5):
        m.rollback(k)
        assert torch.equal(row_of(m), fresh_row(backend, compiled, ids[: len(ids) - k]))
        assert m.accept_tokens(ids[len(ids) - k :] + [eos]) == k + 1 and m.is_terminated()
        m.rollback(1)
    # A fork is independent in both directions, including the terminated flag.
    fork = m.fork()
    assert fork.accept_token(eos) and fork.is_terminated() and not m.is_terminated()
    fork.rollback(4)
    assert torch.equal(row_of(fork), fresh_row(backend, compiled, ids[:-3]))
    assert torch.equal(row_of(m), fresh_row(backend, compiled, ids))
    with pytest.raises(GrammarStateError):
        m.rollback(len(ids) + 1)
    assert not m._m.is_error()


def test_refused_token_is_a_no_op(tok, backend, compiled, ids, eos):
    m = backend.matcher(compiled)
    pos = ids.index(tok.encode(",", add_special_tokens=False)[0])  # right after the first value
    m.accept_tokens(ids[:pos])
    before = row_of(m)
    allowed = set(allowed_token_ids(before))
    first_bytes = {m.info.token_bytes[t][:1] for t in allowed}
    # Refused tokens whose first byte is legal here (only the rest is illegal), plus EOS
    # mid-document.
    near = [
        t
        for t in range(m.info.tokenizer_vocab_size)
        if t not in allowed and m.info.token_bytes[t][:1] in first_bytes
    ]
    assert near
    refused = near[:50] + [eos, tok.encode("x", add_special_tokens=False)[0]]
    for t in refused:
        assert not m.accept_token(t)
        assert torch.equal(row_of(m), before)
    assert not m._m.is_error()
    assert m.accept_tokens(ids[pos:]) == len(ids) - pos


def test_rows_are_the_parsers_allowed_sets(backend, compiled, ids, eos):
    """At every state of the instance the row is exactly the set of tokens llguidance's parser
    accepts (every spelling, also where llguidance's own mask keeps only the canonical one),
    plus EOS exactly where the document can end; accept and validate agree with the row."""
    m = backend.matcher(compiled)
    everything = list(range(m.info.tokenizer_vocab_size))
    raw = np.zeros(m.info.bitmask_width, dtype=np.int32)
    completed = 0
    for p in range(len(ids) + 1):
        row = row_of(m)
        assert bit(row, eos) == (p == len(ids))
        m._m.unsafe_compute_mask_ptr(raw.ctypes.data, raw.nbytes)
        llg_mask = set(allowed_token_ids(torch.from_numpy(raw))) - {eos}
        parser_ok = {t for t in everything if t != eos and m._m.validate_tokens([t])}
        assert set(allowed_token_ids(row)) - {eos} == parser_ok, p
        completed += len(parser_ok - llg_mask)
        for t in sorted(parser_ok)[:: max(1, len(parser_ok) // 10)] + [eos, ids[0]]:
            f = m.fork()
            assert f.validate_tokens([t]) == bit(row, t), (p, t)
            assert f.accept_token(t) == bit(row, t), (p, t)
        if p < len(ids):
            assert m.accept_token(ids[p])
    assert completed > 0  # llguidance's own masks were narrower somewhere on this instance


def test_validate_does_not_mutate(backend, compiled, ids, eos):
    m = backend.matcher(compiled)
    start = row_of(m)
    assert m.validate_tokens(ids + [eos, ids[0]]) == len(ids) + 1
    bad = list(ids)
    bad[9] = eos
    assert m.validate_tokens(bad) == 9
    assert m.validate_tokens(ids[:5] + [m.info.tokenizer_vocab_size + 1] + ids[5:]) == 5
    assert m.num_accepted == 0 and torch.equal(row_of(m), start)
    m.accept_tokens(ids)  # llguidance is_stopped() here; its validate_tokens([EOS]) says 0 (G6)
    assert m._m.is_stopped()
    assert m.validate_tokens([eos]) == 1 and not m.is_terminated()
    m.accept_token(eos)
    assert m.validate_tokens([eos]) == 0


def check_forced(m, eos) -> list[int]:
    """Forced tokens at ``m``'s state spell text every continuation starts with, each is allowed
    at its state and no token allowed there extends it (the model could not write more in one
    token), EOS is never one of them, and ``m`` is unchanged. Returns them."""
    tb = m.info.token_bytes
    before, n_before = row_of(m), m.num_accepted
    forced = m.forced_tokens()
    text = b"".join(tb[t] for t in forced)
    assert eos not in forced
    for t in allowed_token_ids(before) if forced else []:
        assert t != eos and (text.startswith(tb[t]) or tb[t].startswith(text))
    f = m.fork()
    for t in forced:
        row = row_of(f)
        assert bit(row, t)
        assert not [
            u for u in allowed_token_ids(row) if len(tb[u]) > len(tb[t]) and tb[u].startswith(tb[t])
        ]
        assert f.accept_token(t)
    assert torch.equal(row_of(m), before) and m.num_accepted == n_before
    return forced


def test_forced_tokens_along_a_document(backend, compiled, ids, eos):
    m = backend.matcher(compiled)
    seen_forced = 0
    for p in range(len(ids) + 1):
        seen_forced += len(check_forced(m, eos))
        if p < len(ids):
            m.accept_token(ids[p])
    assert seen_forced >= 10  # keys of required properties are forced


@pytest.mark.parametrize("phrase", ["Alignment", "Browser Webview", "Audio Codec", "Company name"])
def test_forced_tokens_stop_before_a_token_a_longer_one_extends(backend, eos, phrase):
    # llguidance's canonical spelling of "Alignment" starts with "Al", yet "Align" is allowed too.
    m = backend.matcher(backend.compile(Regex(phrase + "[0-9]")))
    forced = check_forced(m, eos)
    assert phrase.encode().startswith(b"".join(m.info.token_bytes[t] for t in forced))


def test_padding_ids_never_allowed(tok, backend):
    m = backend.matcher(backend.compile(Regex(r"(.|\n)*")))
    n_tok = len(tok)
    row = row_of(m)
    assert allowed_token_ids(row)[-1] < n_tok and len(allowed_token_ids(row)) > 40000
    assert not m.accept_token(n_tok) and not m.accept_token(n_tok + PAD - 1)
    with pytest.raises(InvalidTokenError):
        m.accept_token(n_tok + PAD)
    tree = DraftTree.from_parents(
        [0, n_tok + 3, -1, tok.encode("a", add_special_tokens=False)[0]], [-1, 0, 0, 0]
    )
    bm = allocate_token_bitmask(4, m.info.vocab_size)
    assert m.fill_tree_bitmask(tree, bm).tolist() == [True, False, False, True]
    assert not bm[1:3].any() and allowed_token_ids(bm[3])[-1] < n_tok


def test_llguidance_needs_vocab_size_at_least_the_tokenizer(tok):
    with pytest.raises(ValueError, match="logits width"):
        LLGuidanceBackend(tok, vocab_size=len(tok) - 10)


# -- draft trees ---------------------------------------------------------------------------------


@st.composite
def draft_trees(draw, ids: list[int], eos: int, n_tok: int):
    """(root position p, tree): the root is the state after ``ids[:p]``; children mix the true
    continuation, tokens of the instance, EOS, padding / out-of-range ids and random ids."""
    p = draw(
        st.one_of(st.integers(0, len(ids)), st.integers(len(ids) - 3, len(ids)))
    )  # + near the end
    n = draw(st.integers(1, 20))
    tokens, parents, depth = [ids[p - 1] if p else eos], [-1], [0]
    for i in range(1, n):
        par = draw(st.integers(0, i - 1))
        d = depth[par] + 1
        kind = draw(
            st.sampled_from(["true", "true", "true", "instance", "eos", "pad", "neg", "random"])
        )
        if kind == "true":
            t = ids[p + d - 1] if p + d - 1 < len(ids) else eos
        elif kind == "instance":
            t = draw(st.sampled_from(ids))
        elif kind == "eos":
            t = eos
        elif kind == "pad":
            t = n_tok + draw(st.integers(0, PAD - 1))
        elif kind == "neg":
            t = -1
        else:
            t = draw(st.integers(0, n_tok - 1))
        tokens.append(t)
        parents.append(par)
        depth.append(d)
    return p, DraftTree.from_parents(tokens, parents)


def oracle_tree(backend, compiled, prefix, tree):
    """Rows and validity by fresh-matcher replay of every root..node path."""
    n = tree.num_nodes
    rows = torch.zeros((n, backend.tokenizer_info.bitmask_width), dtype=torch.int32)
    valid = [False] * n
    valid[0] = True
    n_tok = backend.tokenizer_info.tokenizer_vocab_size
    for node in range(n):
        if node:
            par, t = tree.parent_list[node], tree.token_list[node]
            valid[node] = valid[par] and 0 <= t < n_tok and bit(rows[par], t)
        if valid[node]:
            r = fresh_row(backend, compiled, prefix + tree.path(node))
            if r is not None:
                rows[node] = r
    return rows, valid


def test_tree_rows_equal_fresh_replay(tok, backend, compiled, par_backend, schema, ids, eos):
    n_tok = len(tok)
    par_compiled = par_backend.compile(JsonSchema(schema))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(draft_trees(ids, eos, n_tok))
    def check(case):
        p, tree = case
        n = tree.num_nodes
        m = backend.matcher(compiled)
        m.accept_tokens(ids[:p])
        before = row_of(m)
        rows, valid = oracle_tree(backend, compiled, ids[:p], tree)

        bm = allocate_token_bitmask(n + 2, m.info.vocab_size)
        got = m.fill_tree_bitmask(tree, bm, row_offset=1)
        assert got.tolist() == valid
        assert torch.equal(bm[1 : n + 1], rows)
        assert (bm[0] == -1).all() and (bm[n + 1] == -1).all()  # rows outside untouched

        ref = allocate_token_bitmask(n, m.info.vocab_size)
        assert fill_tree_bitmask_dfs(m, tree, ref).tolist() == valid
        clear_padding_bits(ref, 0, n, n_tok)
        assert torch.equal(ref, rows)

        # Many requests at once (parallel executor path), one of them at another state.
        pm, other = par_backend.matcher(par_compiled), par_backend.matcher(par_compiled)
        pm.accept_tokens(ids[:p])
        jobs = [(pm, tree, 0), (pm.fork(), tree, n), (other, tree, 2 * n)]
        par = allocate_token_bitmask(3 * n, m.info.vocab_size)
        vs = par_backend.fill_tree_bitmasks(jobs, par)
        assert vs[0].tolist() == valid and vs[1].tolist() == valid
        assert torch.equal(par[:n], rows) and torch.equal(par[n : 2 * n], rows)
        rows0, valid0 = oracle_tree(backend, compiled, [], tree)
        assert vs[2].tolist() == valid0 and torch.equal(par[2 * n :], rows0)
        # zero_dead_rows=False (SGLang's hook): the same live rows, dead rows not written
        kept = torch.full_like(par, 0x5A5A5A5A)
        vk = par_backend.fill_tree_bitmasks(jobs, kept, zero_dead_rows=False)
        assert [v.tolist() for v in vk] == [v.tolist() for v in vs]
        live = [
            j * n + k
            for j, v in enumerate(vs)
            for k, ok in enumerate(v.tolist())
            if ok and (k == 0 or tree.token_list[k] != eos)
        ]
        assert torch.equal(kept[live], par[live])

        for mm, prefix_len in ((m, p), (pm, p), (jobs[1][0], p), (other, 0)):
            assert mm.num_accepted == prefix_len and not mm._m.is_error()
        assert torch.equal(row_of(m), before) and torch.equal(row_of(pm), before)
        assert torch.equal(row_of(other), fresh_row(backend, compiled, []))

    check()


def test_tree_with_shared_matcher_and_terminated_job(par_backend, schema, ids, eos):
    compiled = par_backend.compile(JsonSchema(schema))
    m = par_backend.matcher(compiled)
    tree = DraftTree.chain(eos, ids[:4])
    bm = allocate_token_bitmask(2 * tree.num_nodes, par_backend.vocab_size)
    vs = par_backend.fill_tree_bitmasks([(m, tree, 0), (m, tree, tree.num_nodes)], bm)
    assert vs[0].tolist() == vs[1].tolist() == [True] * 5
    assert torch.equal(bm[:5], bm[5:]) and m.num_accepted == 0
    done = par_backend.matcher(compiled)
    done.accept_tokens(ids + [eos])
    with pytest.raises(GrammarStateError):
        par_backend.fill_tree_bitmasks([(m, tree, 0), (done, tree, 5)], bm)


def test_batched_fill_never_waits_for_an_idle_helper(par_backend, schema, ids):
    """The batched fill returns once every job is done, by whichever thread: a helper that never
    starts (a starved pool thread on a busy host) costs nothing, and one that starts after the
    call finds no job left. Rows and validity equal each request's own fill."""
    compiled = par_backend.compile(JsonSchema(schema))
    ms = [par_backend.matcher(compiled) for _ in range(3)]
    trees = []
    for k, m in enumerate(ms):
        m.accept_tokens(ids[: k + 1])
        trees.append(DraftTree(ids[k : k + 5] + [ids[k + 2]], [-1, 0, 1, 2, 3, 0]))
    n = 6
    late = []
    got = allocate_token_bitmask(3 * n, par_backend.vocab_size)
    jobs = [(m._m, t, j * n) for j, (m, t) in enumerate(zip(ms, trees))]
    valids, errors = fill_trees(
        jobs,
        got,
        n_tok=par_backend.tokenizer_info.tokenizer_vocab_size,
        stops=frozenset(par_backend.tokenizer_info.stop_token_ids),
        vocab=par_backend.vocab_index,
        zero_dead=True,
        submit=late.append,  # helpers queued, never run during the call
        threads=3,
    )
    assert len(late) == 2 and not errors
    for fn in late:
        fn()  # a helper that starts afterwards: nothing left, nothing written
    want = allocate_token_bitmask(3 * n, par_backend.vocab_size)
    for j, (m, t) in enumerate(zip(ms, trees)):
        assert valids[j].tolist() == m.fill_tree_bitmask(t, want, j * n).tolist()
        assert m.num_accepted == j + 1
    assert torch.equal(got, want)
    assert not valids[0][5]  # a rejected node too: ids[2] right after the root ids[0]


# -- grammar kinds and compile errors ------------------------------------------------------------


def test_vocab_index_proper_prefixes_match_a_scan(tok, backend):
    """The row completion's prefix lookup against a scan of the whole vocabulary."""
    vocab = backend.vocab_index
    info = backend.tokenizer_info
    specials = info.special_token_ids
    for text in [b'{"status": "inactive"', b"  hello world", b"\xe2\x82\xac1", b"a"]:
        want = sorted(
            (b, t)
            for t, b in enumerate(info.token_bytes)
            if b and t not in specials and len(b) < len(text) and text.startswith(b)
        )
        assert vocab.proper_prefixes(text) == [t for _, t in want], text


@pytest.mark.parametrize(
    "spec, sample, wrong",
    [
        (
            Regex(r"[A-Z]{3}-[0-9]{4} (active|inactive) [a-z]+@[a-z]+\.com"),
            "ABC-1234 active bob@mail.com",
            "ABC-123 active",
        ),
        (
            Lark(
                'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUMBER | "(" expr ")"\n%import common.NUMBER'
            ),
            "(1+22)-3",
            "1++",
        ),
        (
            Ebnf('root ::= "{" pair ("," pair)* "}"\npair ::= [a-z]+ "=" [0-9]+'),
            "{ab=1,c=23}",
            "{ab=}",
        ),
        (Ebnf('expr ::= "x" digit+\ndigit ::= [0-9]', root="expr"), "x42", "xx"),
    ],
    ids=["regex", "lark", "gbnf", "gbnf-root"],
)
def test_grammar_kinds_accept_a_sample(tok, backend, eos, spec, sample, wrong):
    compiled = backend.compile(spec)
    m = backend.matcher(compiled)
    toks = tok.encode(sample, add_special_tokens=False)
    assert m.accept_tokens(toks + [eos]) == len(toks) + 1 and m.is_terminated()
    # EOS here ends a state that could still go on, where llguidance itself would record EOS
    # in its history (it does not after is_stopped()): rollback must be exact either way.
    for k in (1, 2):
        m.rollback(1)
        assert torch.equal(row_of(m), fresh_row(backend, compiled, toks[: len(toks) + 1 - k]))
    bad = tok.encode(wrong, add_special_tokens=False) + [eos]
    assert backend.matcher(compiled).validate_tokens(bad) < len(bad)


@pytest.mark.parametrize(
    "whitespace, accepted, refused",
    [
        ("spaced", ['{"a": 1, "b": [1, 2]}'], ['{"a":1,"b":[1,2]}', '{ "a": 1, "b": [1, 2]}']),
        ("compact", ['{"a":1,"b":[1,2]}'], ['{"a": 1, "b": [1, 2]}']),
        (
            "flexible",
            ['{"a":1,"b":[1,2]}', '{"a": 1, "b": [1, 2]}', '{\n  "a" : 1,\n  "b": [ 1 , 2 ]\n}'],
            [],
        ),
    ],
)
def test_json_whitespace_policies(tok, backend, eos, whitespace, accepted, refused):
    # The schema's own x-guidance options must not override the spec's whitespace policy.
    schema = {
        "type": "object",
        "x-guidance": {"whitespace_pattern": "[ ]*"},
        "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
        "required": ["a", "b"],
    }
    compiled = backend.compile(JsonSchema(schema, whitespace=whitespace))
    for text in accepted + refused:
        toks = tok.encode(text, add_special_tokens=False) + [eos]
        assert (backend.matcher(compiled).validate_tokens(toks) == len(toks)) == (
            text in accepted
        ), text


def test_json_schema_semantics(tok, backend, eos):
    def accepts(schema, text):
        toks = tok.encode(text, add_special_tokens=False) + [eos]
        return backend.matcher(backend.compile(JsonSchema(schema))).validate_tokens(toks) == len(
            toks
        )

    props = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(props, '{"a": 1, "zz": [true]}')  # additionalProperties defaults to allowed
    assert not accepts({**props, "additionalProperties": False}, '{"a": 1, "zz": [true]}')
    assert accepts(True, '[1, "x"]')


def test_tool_calls_compile_and_force_the_call_head(tok, backend):
    case = next(c for c in bfcl_cases() if len(c["tools"]) == 1)
    fn = case["tools"][0].get("function", case["tools"][0])
    m = backend.matcher(backend.compile(ToolCalls(case["tools"])))
    forced = m.forced_tokens()  # single tool: the name const and the keys are forced
    assert m.accept_tokens(forced) == len(forced)
    assert m.info.decode(forced).startswith(
        json.dumps([{"name": fn["name"], "arguments": {}}])[:-4]
    )


@pytest.mark.parametrize(
    "spec, error",
    [
        (Regex("a(b"), GrammarCompileError),
        (Lark("start: undefined_rule"), GrammarCompileError),
        (Ebnf('root ::= ("a"'), GrammarCompileError),
        (Ebnf("root ::= missing"), GrammarCompileError),
        (Ebnf('root ::= "a"\nexpr ::= "b"', root="expr"), UnsupportedGrammarError),
        (JsonSchema({"type": "integer", "minimum": 5, "maximum": 2}), GrammarCompileError),
        (JsonSchema(False), GrammarCompileError),
        # look-around has no translation: left out with a warning, refused in strict mode
        (JsonSchema({"type": "string", "pattern": "(?=a)b"}, strict=True), UnsupportedGrammarError),
        (JsonSchema({"type": "array", "uniqueItems": True}, strict=True), UnsupportedGrammarError),
    ],
)
def test_bad_grammars_raise_typed_errors(backend, spec, error):
    with pytest.raises(error) as info:
        backend.compile(spec)
    assert info.value.backend == "llguidance" and info.value.reason
    if error is GrammarCompileError:
        assert not isinstance(info.value, UnsupportedGrammarError)


def test_non_strict_schemas_ignore_only_documented_keywords(tok, backend, eos):
    # uniqueItems (library semantics, as xgrammar) and unknown formats (annotations) are ignored;
    # any other unimplemented keyword would make the grammar accept invalid documents.
    m = backend.matcher(backend.compile(JsonSchema({"type": "array", "uniqueItems": True})))
    toks = tok.encode("[1, 1]", add_special_tokens=False) + [eos]
    assert m.validate_tokens(toks) == len(toks)
    backend.compile(JsonSchema({"type": "string", "format": "no-such-format"}))
    with pytest.raises(UnsupportedGrammarError):
        backend.compile(JsonSchema({"type": "string", "format": "no-such-format"}, strict=True))
    with pytest.raises(UnsupportedGrammarError, match="not"):
        backend.compile(JsonSchema({"type": "array", "items": {"not": {"type": "string"}}}))
