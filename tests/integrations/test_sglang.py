"""spec-grammar inside SGLang (spec_grammar.integrations.sglang), against SGLang's own code.

Oracles: SGLang's own ``generate_token_bitmask`` / ``traverse_tree`` (its Python walk over our
grammar objects), a fresh matcher replaying each node's path, SGLang's argument parser and
``create_grammar_backend``, its ``build_grammar_vocab_mask`` / ``GrammarMask`` and its result
processor's ``_accept_grammar_tokens``. Needs the ``sglang`` extra and runs on the CPU
(``bash scripts/test_sglang.sh``); skipped when SGLang is not installed.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")
pytest.importorskip("triton")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.constrained import base_grammar_backend as sgl_base  # noqa: E402
from sglang.srt.speculative import spec_utils  # noqa: E402

from spec_grammar.integrations.sglang import PREFIX, TREE_FILL_ENV, backend_names, register  # noqa: E402
from spec_grammar.integrations.sglang.grammar import (  # noqa: E402
    SGLangGrammar,
    SGLangGrammarBackend,
)
from spec_grammar.integrations.sglang.tree_fill import TARGET, generate_token_bitmask  # noqa: E402

# SGLang's own function, kept in a dict: applying a hook rebinds every module attribute that
# holds the original (HookRegistry's _propagate_patch), a module-level name here included
_SGLANG = {"generate": spec_utils.generate_token_bitmask}


def SGLANG_GENERATE(*args):
    return _SGLANG["generate"](*args)


BACKENDS = ["xgrammar", "llguidance", "outlines"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
INSTANCE = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poet"]})


@pytest.fixture(scope="module")
def sgl_tok(tok):
    register()
    return tok


@pytest.fixture(scope="module")
def sgl_backends(sgl_tok):
    """``{name: SGLangGrammarBackend}`` built by the registered factories."""
    out = {}
    for name in BACKENDS:
        init = sgl_base.GRAMMAR_BACKEND_REGISTRY[PREFIX + name]
        out[name] = init(SimpleNamespace(), sgl_tok, len(sgl_tok), {sgl_tok.eos_token_id})
    return out


@pytest.fixture(scope="module")
def doc(sgl_tok):
    return sgl_tok.encode(INSTANCE, add_special_tokens=False)


def _grammar(backends, name) -> SGLangGrammar:
    g = backends[name].dispatch_json(json.dumps(SCHEMA))
    assert isinstance(g, SGLangGrammar), g
    return g


def _links(parents: list[int], reverse_siblings: bool) -> tuple[list[int], list[int]]:
    """SGLang's first-child / next-sibling links of a parent list."""
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n)]
    for c in range(1, n):
        kids[parents[c]].append(c)
    nxt, sib = [-1] * n, [-1] * n
    for p, ks in enumerate(kids):
        if reverse_siblings:
            ks = ks[::-1]
        if ks:
            nxt[p] = ks[0]
            for a, b in zip(ks, ks[1:]):
                sib[a] = b
    return nxt, sib


@st.composite
def _batch(draw, doc_len: int, vocab: int, eos: int):
    """A batch: per request a kind (no grammar / terminated / live at a doc position) and a
    random tree whose tokens are mostly the document's next tokens (deep valid paths), with
    EOS, random ids and ids >= vocab (n-gram padding) mixed in."""
    bs = draw(st.integers(1, 4))
    n = draw(st.sampled_from([1, 4, 8, 16]))
    reverse = draw(st.booleans())
    reqs = []
    for _ in range(bs):
        kind = draw(st.sampled_from(["live", "live", "live", "none", "terminated"]))
        pos = draw(st.integers(0, doc_len))
        parents = [-1] + [draw(st.integers(0, c - 1)) for c in range(1, n)]
        tokens = [0] * n
        depth = [0] * n
        for c in range(1, n):
            depth[c] = depth[parents[c]] + 1
            k = pos + depth[c] - 1
            choice = draw(st.sampled_from(["doc", "doc", "doc", "eos", "rand", "pad"]))
            if choice == "doc" and k < doc_len:
                tokens[c] = k
            elif choice == "pad":
                tokens[c] = ~(vocab + draw(st.integers(0, 40)))
            elif choice == "rand":
                tokens[c] = ~draw(st.integers(0, vocab - 1))
            else:
                tokens[c] = ~eos
        reqs.append((kind, pos, parents, tokens))
    return n, reverse, reqs


def _materialize(batch, backends, name, doc, eos):
    """Grammar objects and SGLang's tree tensors for a drawn batch. Token encoding of
    ``_batch``: ``k >= 0`` is the document's token ``k``; ``~t`` is the id ``t`` itself."""
    n, reverse, spec = batch
    proto = _grammar(backends, name)
    reqs, toks, nxts, sibs = [], [], [], []
    for kind, pos, parents, tokens in spec:
        g = None
        if kind != "none":
            g = proto.copy()
            for t in doc[:pos]:
                g.accept_token(t)
            if kind == "terminated":
                for t in doc[pos:]:
                    g.accept_token(t)
                g.accept_token(eos)
        ids = [doc[pos - 1] if pos else eos] + [doc[t] if t >= 0 else ~t for t in tokens[1:]]
        nxt, sib = _links(parents, reverse)
        reqs.append(SimpleNamespace(grammar=g, prefix=list(doc[:pos])))
        toks.append(ids)
        nxts.append(nxt)
        sibs.append(sib)
    return reqs, torch.tensor(nxts), torch.tensor(sibs), torch.tensor(toks)


# -- registration -------------------------------------------------------------------------------
def test_names_are_registered(sgl_tok):
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    names = backend_names()
    assert {PREFIX + b for b in BACKENDS} <= set(names)
    for name in names:
        assert name in GRAMMAR_BACKEND_CHOICES
        assert name in sgl_base.GRAMMAR_BACKEND_REGISTRY
    hooks = HookRegistry._hooks[TARGET]
    assert (HookType.REPLACE, generate_token_bitmask) in [(t, h) for t, h, _ in hooks]
    register()  # idempotent: one hook, the choices listed once
    assert [h for _, h, _ in HookRegistry._hooks[TARGET]].count(generate_token_bitmask) == 1
    assert GRAMMAR_BACKEND_CHOICES.count(names[0]) == 1


def _server_args(*argv):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "unused", *argv]))


@pytest.mark.parametrize("name", BACKENDS)
def test_grammar_backend_flag_selects_our_backend(sgl_tok, name):
    from sglang.srt.runtime_context import get_context

    sa = _server_args("--grammar-backend", PREFIX + name)
    assert sa.grammar_backend == PREFIX + name
    get_context().set_server_args(sa)
    backend = sgl_base.create_grammar_backend(sa, sgl_tok, len(sgl_tok), {sgl_tok.eos_token_id})
    assert isinstance(backend, SGLangGrammarBackend)
    assert backend.backend.name == name
    assert backend.whitespace == "flexible"
    g = backend.dispatch_regex(r"[0-9]{3}")
    assert isinstance(g, SGLangGrammar) and g.backend is backend.backend


def test_unknown_backend_name_is_refused_by_the_parser(sgl_tok):
    with pytest.raises(SystemExit):
        _server_args("--grammar-backend", PREFIX + "no-such-backend")


def test_disable_any_whitespace_gives_spaced_json(sgl_tok):
    init = sgl_base.GRAMMAR_BACKEND_REGISTRY[PREFIX + "xgrammar"]
    b = init(
        SimpleNamespace(constrained_json_disable_any_whitespace=True), sgl_tok, len(sgl_tok), None
    )
    assert b.whitespace == "spaced"
    g = b.dispatch_json(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert g.matcher.validate_tokens(sgl_tok.encode('{"a": 1}', add_special_tokens=False)) > 0
    assert g.matcher.validate_tokens(sgl_tok.encode('{ "a"', add_special_tokens=False)) < len(
        sgl_tok.encode('{ "a"', add_special_tokens=False)
    )


# -- bad grammars -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
def test_bad_grammars_become_invalid_objects(sgl_backends, name):
    b = sgl_backends[name]
    bad = b.dispatch_json('{"type": "object", "properties": ')
    assert isinstance(bad, sgl_base.InvalidGrammarObject) and "JSON" in bad.error_message
    bad = b.dispatch_regex("(a")
    assert isinstance(bad, sgl_base.InvalidGrammarObject) and bad.error_message
    tag = b.dispatch_structural_tag("{}")
    assert isinstance(tag, sgl_base.InvalidGrammarObject)
    assert "structural_tag" in tag.error_message
    # SGLang's dispatcher routes by key type and refuses NUL bytes before us
    assert isinstance(
        b._init_value_dispatch(("regex", "a\x00"), False), sgl_base.InvalidGrammarObject
    )


def test_outlines_refuses_ebnf_with_the_reason(sgl_backends):
    bad = sgl_backends["outlines"].dispatch_ebnf('root ::= "a"')
    assert isinstance(bad, sgl_base.InvalidGrammarObject)
    assert "ebnf" in bad.error_message.lower()


# -- per-request objects -----------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
def test_commit_abort_semantics_through_sglang(sgl_backends, sgl_tok, doc, name):
    """SGLang's own accept path: an illegal token aborts that request only, EOS terminates
    and truncates the run, rollback crosses termination, and copies are independent."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as P,
    )

    eos = sgl_tok.eos_token_id
    proto = _grammar(sgl_backends, name)
    good = SimpleNamespace(grammar=proto.copy(), rid="good", to_finish=None)
    bad = SimpleNamespace(grammar=proto.copy(), rid="bad", to_finish=None)
    illegal = sgl_tok.encode("}", add_special_tokens=False)[0]
    assert P._accept_grammar_tokens(None, bad, [doc[0], illegal, doc[1]]) == [doc[0]]
    assert bad.to_finish is not None and "Grammar accept_token failed" in str(
        bad.to_finish.to_json()
    )
    kept = P._accept_grammar_tokens(None, good, doc + [eos, doc[0], doc[1]])
    assert kept == doc + [eos] and good.to_finish is None
    assert good.grammar.is_terminated() and not bad.grammar.is_terminated()
    with pytest.raises(ValueError):
        good.grammar.accept_token(doc[0])  # after termination
    good.grammar.rollback(1)
    assert not good.grammar.is_terminated()
    good.grammar.rollback(len(doc))  # back to the start: the document is accepted again
    assert P._accept_grammar_tokens(None, good, doc) == doc and good.to_finish is None
    fresh = proto.copy()
    assert fresh.matcher.num_accepted == 0 and good.grammar.matcher.num_accepted == len(doc)
    assert fresh.grammar_stats.is_cache_hit


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_reaches_max_rollback_tokens(sgl_backends, sgl_tok, name):
    """Deeper than SGLang's xgrammar matcher (200): our objects keep 256 tokens."""
    g = sgl_backends[name].dispatch_regex("a{0,400}")
    a = sgl_tok.encode("a", add_special_tokens=False)[0]
    row = g.allocate_vocab_mask(len(sgl_tok), 2, "cpu")
    g.fill_vocab_mask(row, 0)
    for _ in range(256):
        g.accept_token(a)
    g.rollback(256)
    g.fill_vocab_mask(row, 1)
    assert torch.equal(row[0], row[1]) and g.matcher.num_accepted == 0
    with pytest.raises(Exception, match="rollback"):
        g.rollback(1)


def test_allocation_is_all_allowed_packed_int32(sgl_backends, sgl_tok):
    g = _grammar(sgl_backends, "xgrammar")
    m = g.allocate_vocab_mask(len(sgl_tok) + 7, 5, "cpu")
    assert m.dtype == torch.int32 and m.shape == (5, (len(sgl_tok) + 7 + 31) // 32)
    assert bool((m == -1).all())
    m[:] = 0
    SGLangGrammar.reset_vocab_mask(m)
    assert bool((m == -1).all())


# -- the tree fill -----------------------------------------------------------------------------
def _check_batch(sgl_backends, sgl_tok, doc, name, batch):
    eos = sgl_tok.eos_token_id
    V = len(sgl_tok)
    reqs, nxt, sib, toks = _materialize(batch, sgl_backends, name, doc, eos)
    before = [None if r.grammar is None else r.grammar.matcher.num_accepted for r in reqs]
    ours, g1 = generate_token_bitmask(reqs, nxt, sib, toks, V)
    after = [None if r.grammar is None else r.grammar.matcher.num_accepted for r in reqs]
    theirs, g2 = SGLANG_GENERATE(reqs, nxt, sib, toks, V)
    assert before == after
    assert g1 is g2
    if theirs is None:
        assert ours is None
        return
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    diff = (ours != theirs).any(dim=1).nonzero().flatten().tolist()
    assert not diff, f"rows {diff[:8]} differ from SGLang's walk"
    # and against a fresh matcher replaying each filled row's path
    n = toks.shape[1]
    proto = _grammar(sgl_backends, name)
    for i, r in enumerate(reqs):
        if r.grammar is None or r.grammar.is_terminated():
            assert bool((ours[i * n : (i + 1) * n] == -1).all())
            continue
        parents = [-1] * n
        for p in range(n):
            c = int(nxt[i, p])
            while c != -1:
                parents[c] = p
                c = int(sib[i, c])
        for node in range(n):
            path, c = [], node
            while c > 0:
                path.append(int(toks[i, c]))
                c = parents[c]
            fresh = proto.copy()
            path = path[::-1]
            ok = all(0 <= t < V for t in path)  # ids >= V (padding) are rejected nodes
            if ok:
                accepted = fresh.matcher.accept_tokens(r.prefix + path)
                ok = accepted == len(r.prefix) + len(path) and not fresh.is_terminated()
            row = ours[i * n + node]
            if not ok:
                assert bool((row == -1).all()), f"request {i} node {node}: rejected but filled"
                continue
            want = fresh.allocate_vocab_mask(V, 1, "cpu")
            fresh.fill_vocab_mask(want, 0)
            assert torch.equal(row, want[0]), f"request {i} node {node}: row differs from replay"


def _tree_property(examples: int):
    def deco(fn):
        return settings(
            max_examples=examples,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )(fn)

    return deco


@pytest.mark.parametrize("name", BACKENDS)
@_tree_property(12)
@given(data=st.data())
def test_tree_fill_rows_identical_to_sglang_walk(sgl_backends, sgl_tok, doc, name, data):
    batch = data.draw(_batch(len(doc), len(sgl_tok), sgl_tok.eos_token_id))
    _check_batch(sgl_backends, sgl_tok, doc, name, batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
@_tree_property(150)
@given(data=st.data())
def test_tree_fill_rows_identical_to_sglang_walk_long(sgl_backends, sgl_tok, doc, name, data):
    batch = data.draw(_batch(len(doc), len(sgl_tok), sgl_tok.eos_token_id))
    _check_batch(sgl_backends, sgl_tok, doc, name, batch)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_hook_tree_links_equal_draft_tree_from_sglang(data):
    """The hook's tree reading (one pass, SGLang's links kept when already in order) gives the
    tree :meth:`DraftTree.from_sglang` builds, in either sibling order; broken links (a cycle,
    a child before its parent, an unreachable node) give None."""
    from spec_grammar.integrations.sglang.tree_fill import _tree
    from spec_grammar.tree import DraftTree

    n = data.draw(st.integers(1, 12))
    parents = [-1] + [data.draw(st.integers(0, c - 1)) for c in range(1, n)]
    nxt, sib = _links(parents, data.draw(st.booleans()))
    tokens = list(range(100, 100 + n))
    want = DraftTree.from_parents(tokens, parents)
    got = _tree(tokens, nxt, sib)
    assert got.parent_list == want.parent_list
    assert got.first_child_list == want.first_child_list
    assert got.next_sibling_list == want.next_sibling_list
    if n > 2:
        broken = data.draw(st.sampled_from(["cycle", "backward", "unreachable"]))
        c = data.draw(st.integers(1, n - 1))
        nxt2, sib2 = list(nxt), list(sib)
        if broken == "cycle":
            sib2[c] = c
        elif broken == "backward":
            nxt2[c] = 0
        else:
            nxt2 = [-1] * n
        assert _tree(tokens, nxt2, sib2) is None


def test_termination_inside_the_tree(sgl_backends, sgl_tok, doc):
    """A chain that completes the document then takes EOS: EOS's row and everything below
    it stay all-allowed, in SGLang's walk and in ours."""
    eos = sgl_tok.eos_token_id
    for name in BACKENDS:
        g = _grammar(sgl_backends, name)
        for t in doc[:-2]:
            g.accept_token(t)
        ids = [doc[-3], doc[-2], doc[-1], eos, doc[0]]
        n = len(ids)
        nxt = torch.tensor([[1, 2, 3, 4, -1]])
        sib = torch.full((1, n), -1)
        toks = torch.tensor([ids])
        reqs = [SimpleNamespace(grammar=g)]
        ours, _ = generate_token_bitmask(reqs, nxt, sib, toks, len(sgl_tok))
        theirs, _ = SGLANG_GENERATE(reqs, nxt, sib, toks, len(sgl_tok))
        assert torch.equal(ours, theirs), name
        assert bool((ours[3:] == -1).all()) and not bool((ours[2] == -1).all())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA hosts pin the mask instead")
def test_tree_mask_memory_is_reused_only_when_released(sgl_backends, sgl_tok, doc):
    """On a CPU host the hook hands out one of its last two masks again once nothing holds
    it: every row is rewritten (a poisoned buffer gives SGLang's rows), and a mask still held
    (or a view of it) is never handed out twice."""
    g = _grammar(sgl_backends, "xgrammar")
    for t in doc[:3]:
        g.accept_token(t)
    ids = [doc[2], doc[3], doc[4], sgl_tok.eos_token_id]
    args = (torch.tensor([[1, 2, -1, -1]]), torch.tensor([[-1, 3, -1, -1]]), torch.tensor([ids]))
    reqs = [SimpleNamespace(grammar=g), SimpleNamespace(grammar=None)]
    args = tuple(torch.cat([a, a]) for a in args)
    theirs, _ = SGLANG_GENERATE(reqs, *args, len(sgl_tok))
    first, _ = generate_token_bitmask(reqs, *args, len(sgl_tok))
    view = first[2:4]
    held, _ = generate_token_bitmask(reqs, *args, len(sgl_tok))
    assert held.data_ptr() != first.data_ptr()  # `first` is in use
    del first
    again, _ = generate_token_bitmask(reqs, *args, len(sgl_tok))
    assert again.data_ptr() not in (view.data_ptr() - 2 * view.stride(0), held.data_ptr())
    again.fill_(0x5A5A5A5A)
    ptr = again.data_ptr()
    del view, again
    reused, _ = generate_token_bitmask(reqs, *args, len(sgl_tok))
    assert reused.data_ptr() == ptr  # one of the last two masks, released
    assert torch.equal(reused, theirs) and torch.equal(held, theirs)
    ptrs = {reused.data_ptr(), held.data_ptr()}
    del reused
    reused, _ = generate_token_bitmask(reqs, *args, len(sgl_tok))
    assert reused.data_ptr() in ptrs


def test_foreign_grammar_objects_keep_sglang_walk(sgl_backends, sgl_tok, doc):
    """A request whose grammar is not ours (here SGLang's llguidance object) is walked by
    SGLang's traverse_tree inside our hook; ours beside it by our fill."""
    from sglang.srt.constrained.llguidance_backend import GuidanceBackend

    sgl = GuidanceBackend(
        tokenizer=sgl_tok,
        any_whitespace=True,
        whitespace_pattern=None,
        n_vocab=len(sgl_tok),
        eos_token_ids={sgl_tok.eos_token_id},
    )
    theirs_obj = sgl.dispatch_json(json.dumps(SCHEMA))
    ours_obj = _grammar(sgl_backends, "llguidance")
    parents = [-1, 0, 1, 1, 2, 0]
    nxt, sib = _links(parents, False)
    ids = [doc[0], doc[1], doc[2], doc[3], doc[3], doc[2]]
    for g in (theirs_obj, ours_obj):
        g.accept_token(doc[0])
    reqs = [SimpleNamespace(grammar=theirs_obj), SimpleNamespace(grammar=ours_obj)]
    args = (reqs, torch.tensor([nxt, nxt]), torch.tensor([sib, sib]), torch.tensor([ids, ids]))
    ours, g1 = generate_token_bitmask(*args, len(sgl_tok))
    ref, g2 = SGLANG_GENERATE(*args, len(sgl_tok))
    assert g1 is g2 is ours_obj
    assert torch.equal(ours, ref)


# -- SGLang's mask path -------------------------------------------------------------------------
def test_build_grammar_vocab_mask_and_apply_on_cpu_logits(sgl_backends, sgl_tok, doc):
    """The hook applied through SGLang's HookRegistry: SGLang's build_grammar_vocab_mask
    then goes through our fill, and GrammarMask.apply sets exactly the disallowed logits to
    -inf."""
    from sglang.srt.plugins.hook_registry import HookRegistry, _propagate_patch

    HookRegistry.apply_hooks()
    try:
        wrapped = spec_utils.generate_token_bitmask
        original = _SGLANG["generate"]
        assert wrapped is not original and wrapped.__wrapped__ is original
        V = len(sgl_tok)
        gs = [_grammar(sgl_backends, b) for b in BACKENDS]
        for g in gs:
            g.accept_token(doc[0])
        parents = [-1, 0, 1, 1, 0, 4]
        nxt, sib = _links(parents, False)
        ids = [doc[0], doc[1], doc[2], doc[5], doc[1], doc[2]]
        reqs = [SimpleNamespace(grammar=g) for g in gs] + [SimpleNamespace(grammar=None)]
        tree = spec_utils.GrammarTree.from_host(
            torch.tensor([nxt] * 4), torch.tensor([sib] * 4), torch.tensor([ids] * 4)
        )
        info = SimpleNamespace(vocab_size=V, grammar_mask="stale")
        gm = spec_utils.build_grammar_vocab_mask(
            reqs=reqs, tree=tree, sampling_info=info, device="cpu", barrier=None
        )
        assert info.grammar_mask is None
        ref, _ = SGLANG_GENERATE(reqs, *tree.resolve(), V)
        assert torch.equal(gm.vocab_mask, ref)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(
                len(reqs) * len(ids), V, generator=torch.Generator().manual_seed(0)
            ).to(dtype)
            out = logits.clone()
            gm.apply(out)
            bits = np.unpackbits(ref.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
            allowed = torch.from_numpy(bits.astype(bool))
            assert torch.equal(out[allowed], logits[allowed])
            assert bool((out[~allowed] == float("-inf")).all())
    finally:
        spec_utils.generate_token_bitmask = _SGLANG["generate"]
        _propagate_patch(wrapped, _SGLANG["generate"], spec_utils)
        HookRegistry._patched.discard(TARGET)


def test_tree_fill_hook_can_be_left_out(monkeypatch, sgl_tok):
    from sglang.srt.plugins.hook_registry import HookRegistry

    import spec_grammar.integrations.sglang as plugin

    monkeypatch.setenv(TREE_FILL_ENV, "0")
    monkeypatch.setattr(plugin, "_hook_registered", False)
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    plugin.register()
    assert TARGET not in HookRegistry._hooks


# -- a speculative loop on SGLang's functions -------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
def test_greedy_tree_speculation_through_sglang_yields_valid_output(sgl_backends, sgl_tok, name):
    """Draft trees -> our tree fill -> SGLang's GrammarMask.apply on random logits -> greedy
    tree verify -> SGLang's accept path, until the grammar terminates: every output matches
    the regex. outlines-core included, which SGLang's own outlines backend cannot serve (it
    has no rollback)."""
    import re

    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as P,
    )

    pattern = r"(yes|no),[0-9]{1,2}(;(yes|no),[0-9]{1,2}){0,2}"
    eos, V = sgl_tok.eos_token_id, len(sgl_tok)
    pieces = ["yes", "no", ",", ";", "1", "2", "7", "42", "y", "es"]
    cands = sorted({t for p in pieces for t in sgl_tok.encode(p, add_special_tokens=False)} | {eos})
    rng = np.random.default_rng(hash(name) % 1000)
    proto = sgl_backends[name].dispatch_regex(pattern)
    for _ in range(3):
        req = SimpleNamespace(grammar=proto.copy(), rid=name, to_finish=None)
        out: list[int] = []
        last = eos  # the root token: any id (its row is the grammar's current state)
        for _step in range(40):
            n = 8
            parents = [-1] + [int(rng.integers(0, c)) for c in range(1, n)]
            ids = [last] + [int(rng.choice(cands)) for _ in range(1, n)]
            nxt, sib = _links(parents, False)
            mask, handle = generate_token_bitmask(
                [req], torch.tensor([nxt]), torch.tensor([sib]), torch.tensor([ids]), V
            )
            gm = sgl_base.GrammarMask(handle, handle.move_vocab_mask(mask, "cpu"))
            logits = torch.from_numpy(rng.standard_normal((n, V)).astype(np.float32))
            logits[:, cands] += 4.0  # a model that likes the candidate tokens
            gm.apply(logits)
            target = logits.argmax(dim=1).tolist()
            node, accepted = 0, []
            while True:  # greedy tree verify: follow the child equal to the target token
                child = next(
                    (c for c in range(1, n) if parents[c] == node and ids[c] == target[node]), None
                )
                if child is None:
                    accepted.append(target[node])  # the bonus token
                    break
                accepted.append(ids[child])
                node = child
            kept = P._accept_grammar_tokens(None, req, accepted)
            assert req.to_finish is None, req.to_finish
            out += kept
            last = kept[-1]
            if req.grammar.is_terminated():
                break
        assert req.grammar.is_terminated() and out[-1] == eos
        assert re.fullmatch(pattern, sgl_tok.decode(out[:-1])), sgl_tok.decode(out)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_grammars_accepting_nothing_become_invalid_objects(sgl_backends, name):
    """A key string that json.loads cannot nest (RecursionError) and an EBNF grammar whose
    start state allows no token (xgrammar: an empty row; llguidance: a failed matcher, which
    raised inside SGLang's mask fill) are refused at dispatch with the reason."""
    b = sgl_backends[name]
    deep = b.dispatch_json("[" * 100_000 + "]" * 100_000)
    assert isinstance(deep, sgl_base.InvalidGrammarObject)
    assert "recursion" in deep.error_message
    empty = b.dispatch_ebnf("root ::= root")
    assert isinstance(empty, sgl_base.InvalidGrammarObject)
    assert "accepts no document" in empty.error_message
    ok = b.dispatch_ebnf('root ::= "a" | root')  # recursion with a way out is served
    assert isinstance(ok, SGLangGrammar)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_a_state_with_no_continuation_aborts_only_its_request(sgl_backends, sgl_tok, doc, name):
    """``"a" x`` with ``x ::= x`` reaches a state that allows nothing: xgrammar gives an empty
    row, llguidance's matcher fails (GrammarStateError, a RuntimeError, which SGLang's mask
    fill and its ``except ValueError`` around accept_token did not catch: the scheduler
    crashed). Now the row is all-zero, the next accept_token raises ValueError (SGLang aborts
    that request), rollback recovers, and in the tree hook a dead draft node leaves the other
    requests of the batch (same backend) with SGLang's rows."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as P,
    )

    V = len(sgl_tok)
    a, b = (sgl_tok.encode(c, add_special_tokens=False)[0] for c in "ab")
    proto = sgl_backends[name].dispatch_ebnf('root ::= "a" x | "b"\nx ::= x')
    assert isinstance(proto, SGLangGrammar)
    g = proto.copy()
    rows = g.allocate_vocab_mask(V, 3, "cpu")
    g.fill_vocab_mask(rows, 0)
    g.accept_token(a)
    g.fill_vocab_mask(rows, 1)
    assert not bool(rows[1].any())
    req = SimpleNamespace(grammar=g, rid="dead", to_finish=None)
    assert P._accept_grammar_tokens(None, req, [b]) == []
    assert req.to_finish is not None
    g.rollback(1)
    g.fill_vocab_mask(rows, 2)
    assert torch.equal(rows[0], rows[2])

    # the tree hook: a healthy request beside one whose tree holds the dead node
    good = _grammar(sgl_backends, name)
    for t in doc[:3]:
        good.accept_token(t)
    reqs = [SimpleNamespace(grammar=good), SimpleNamespace(grammar=proto.copy())]
    nxt = torch.tensor([[1, 2, -1, -1], [1, -1, -1, -1]])
    sib = torch.tensor([[-1, -1, -1, -1], [-1, 2, 3, -1]])
    toks = torch.tensor([[doc[2], doc[3], doc[4], 0], [0, a, b, b]])
    for _ in range(2):  # and again: the matchers are usable after the failure
        ours, _ = generate_token_bitmask(reqs, nxt, sib, toks, V)
        theirs, _ = SGLANG_GENERATE(reqs, nxt, sib, toks, V)
        assert torch.equal(ours, theirs)
        assert not bool(ours[5].any()) and torch.equal(ours[4], rows[0])
        assert good.matcher.num_accepted == 3 and reqs[1].grammar.matcher.num_accepted == 0


def test_a_walk_that_raises_leaves_our_grammar_where_it_was(sgl_backends, sgl_tok, doc):
    """Cyclic sibling links send SGLang's traverse_tree (which the hook uses for links it
    cannot read as a tree) into RecursionError after hundreds of accept_token calls without
    their rollbacks; the hook re-raises with the grammar back at its state (replay oracle)."""
    V = len(sgl_tok)
    for name in BACKENDS:
        g = _grammar(sgl_backends, name)
        for t in doc[:5]:
            g.accept_token(t)
        want = g.allocate_vocab_mask(V, 2, "cpu")
        g.fill_vocab_mask(want, 0)
        nxt = torch.tensor([[1, -1, -1]])
        sib = torch.tensor([[-1, 2, 1]])  # node 1 -> 2 -> 1 -> ...
        toks = torch.tensor([[doc[4], doc[5], doc[5]]])
        with pytest.raises(RecursionError):
            generate_token_bitmask([SimpleNamespace(grammar=g)], nxt, sib, toks, V)
        assert g.matcher.num_accepted == 5 and list(g.path) == doc[:5]
        g.fill_vocab_mask(want, 1)
        assert torch.equal(want[0], want[1]), name


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_with_a_lone_trailing_backslash_is_refused(sgl_backends, sgl_tok, name):
    """``a\\`` is not a regex (Python's re and xgrammar / outlines-core refuse it);
    llguidance's grammar_from_regex dropped the backslash and served ``a``. An escaped
    backslash stays a literal one."""
    b = sgl_backends[name]
    for bad in ("a\\", "\\", "a\\\\\\"):
        g = b.dispatch_regex(bad)
        assert isinstance(g, sgl_base.InvalidGrammarObject), (bad, g)
    g = b.dispatch_regex("a\\\\")
    assert isinstance(g, SGLangGrammar)
    ids = sgl_tok.encode("a\\", add_special_tokens=False)
    assert g.matcher.validate_tokens(ids + [sgl_tok.eos_token_id]) == len(ids) + 1


@pytest.mark.parametrize("name", BACKENDS)
@_tree_property(10)
@given(data=st.data())
def test_object_contract_against_fresh_replay(sgl_backends, sgl_tok, doc, name, data):
    """Random accept / refused token / rollback (also past the history) / copy sequences on
    SGLang grammar objects: a refused token or a refused rollback changes nothing, copies
    diverge freely, and every object's row and termination equal a fresh matcher replaying
    its accepted tokens."""
    V, eos = len(sgl_tok), sgl_tok.eos_token_id
    proto = _grammar(sgl_backends, name)
    objs, paths = [proto.copy()], [[]]

    def row(g):
        m = g.allocate_vocab_mask(V, 1, "cpu")
        g.fill_vocab_mask(m, 0)
        return m[0]

    for _ in range(data.draw(st.integers(1, 12))):
        i = data.draw(st.integers(0, len(objs) - 1))
        g, p = objs[i], paths[i]
        op = data.draw(st.sampled_from(["doc", "doc", "eos", "bad", "rollback", "copy"]))
        if op in ("doc", "eos") and not g.is_terminated() and p == doc[: len(p)]:
            # some more of the document, or all of it and EOS
            more = doc[len(p) :] + [eos] if op == "eos" else doc[len(p) : len(p) + 6]
            for t in more:
                g.accept_token(t)
                p.append(t)
        elif op == "bad":
            t = data.draw(st.sampled_from([-1, V, V + 7, 2**40, sgl_tok.encode("}")[0]]))
            live = not g.is_terminated()
            before = row(g) if live else None
            if live and 0 <= t < V and (int(before[t // 32]) >> (t % 32)) & 1:
                continue  # allowed here
            with pytest.raises(ValueError):
                g.accept_token(t)
            assert list(g.path) == p and (not live or torch.equal(row(g), before))
        elif op == "rollback":
            k = data.draw(st.integers(0, len(p) + 2))
            if k > len(p):
                with pytest.raises(Exception, match="rollback"):
                    g.rollback(k)
            else:
                g.rollback(k)
                del p[len(p) - k :]
        elif op == "copy":
            objs.append(g.copy())
            paths.append(list(p))
    for g, p in zip(objs, paths):
        fresh = proto.copy()
        assert fresh.matcher.accept_tokens(p) == len(p) and list(g.path) == p
        assert g.is_terminated() == fresh.is_terminated()
        if not g.is_terminated():
            assert torch.equal(row(g), row(fresh))


def test_bench_trees_give_both_sides_the_same_nodes():
    """The SGLang tree-fill benchmark's default trees count a child as valid only when both
    grammars allow it, so SGLang's walk over its built-in objects and our hook fill the rows of
    the same nodes (SGLang's llguidance masks allow only the canonical spelling of forced text,
    ours every spelling: trees grown from ours alone gave our rows more nodes)."""
    sglang_tree = pytest.importorskip("spec_grammar_bench.sglang_tree")
    rows = sglang_tree.run(["smollm2"], ["llguidance", "xgrammar"], [16], [4], 1, 2, 0)
    assert {r["library"] for r in rows} == {"llguidance", "xgrammar"}
    for r in rows:
        assert r["filled_sglang"] == r["filled_ours"] > 4, r


def test_threads_env_sets_the_tree_fill_threads(monkeypatch, sgl_tok):
    """SPEC_GRAMMAR_SGLANG_THREADS reaches every backend's ``num_threads`` (outlines has none);
    a malformed value is refused naming the variable."""
    from spec_grammar.integrations.sglang.grammar import THREADS_ENV, make_backend_factory

    vocab = len(sgl_tok)
    defaults = {
        n: make_backend_factory(n)(SimpleNamespace(), sgl_tok, vocab).backend for n in BACKENDS
    }
    monkeypatch.setenv(THREADS_ENV, "3")
    for name in BACKENDS:
        backend = make_backend_factory(name)(SimpleNamespace(), sgl_tok, vocab).backend
        assert getattr(backend, "num_threads", None) == (
            3 if hasattr(defaults[name], "num_threads") else None
        )
    assert defaults["xgrammar"].num_threads == 1
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            make_backend_factory("xgrammar")(SimpleNamespace(), sgl_tok, vocab)
