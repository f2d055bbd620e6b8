"""Bounded resources per request (issue 20, part 3), on every backend with the real SmolLM2
tokenizer: ``fork`` and tree fills keep no O(output) work, forced-token searches stop at
``max_forced_tokens``, and compiles an outlines index would blow up are refused with a typed
error. Oracles: fresh-matcher replay of every path (rows and forced tokens), the library's
own refusals, and a child process under ``RLIMIT_AS`` for the memory-capped runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.errors import GrammarLimitError
from spec_grammar.registry import get_backend
from spec_grammar.specs import JsonSchema, Regex
from spec_grammar.tree import DraftTree

BACKENDS = ["xgrammar", "llguidance", "outlines"]
INT_ARRAY = JsonSchema({"type": "array", "items": {"type": "integer"}}, whitespace="compact")
LONG = 20_000


@pytest.fixture(scope="module")
def doc_ids(tok):
    """Tokens of ``[1,2,3,...``: an open array of integers, more than LONG + 50 tokens."""
    ids = tok.encode("[" + ",".join(str(i) for i in range(1, 9000)), add_special_tokens=False)
    assert len(ids) > LONG + 50
    return ids


def _backend(name, tok, **kw):
    pytest.importorskip({"outlines": "outlines_core"}.get(name, name))
    return get_backend(name, tok, **kw)


def _row(m):
    bm = allocate_token_bitmask(1, m.info.vocab_size)
    m.fill_next_token_bitmask(bm, 0)
    return bm.numpy()[0].copy()


def _replay(backend, compiled, tokens):
    m = backend.matcher(compiled)
    assert m.accept_tokens(tokens) == len(tokens)
    return m


def _tree(tok, root):
    d1, d2, comma = (tok.convert_tokens_to_ids(x) for x in ("1", "2", ","))
    return DraftTree.from_parents(
        tokens=[root, d1, d2, comma, d2, comma], parents=[-1, 0, 0, 1, 3, 2]
    )


@pytest.mark.parametrize("name", BACKENDS)
def test_fork_after_a_long_output_shares_its_history(name, tok, doc_ids):
    """After 20,000 accepted tokens a fork copies nothing that grows with the output: xgrammar
    and llguidance forks share one library matcher (moved by rollback + replay of the tokens
    the views differ by, counted in ``moves``); outlines forks share an immutable state chain
    bounded by max_rollback_tokens. Parent and fork then go separate ways, in turn, and every
    row equals a fresh matcher's replay of that path."""
    backend = _backend(name, tok, max_rollback_tokens=8)
    compiled = backend.compile(INT_ARRAY)
    m = backend.matcher(compiled)
    assert m.accept_tokens(doc_ids[:LONG]) == LONG
    f = m.fork()
    if name == "outlines":
        assert f._top is m._top
        assert m.history_length <= 2 * (backend.max_rollback_tokens + 1)
    else:
        assert f._shared is m._shared and m._shared.copies == 0
        moves_before = m._shared.moves
    comma, d7 = tok.convert_tokens_to_ids(","), tok.convert_tokens_to_ids("7")
    path_m, path_f = list(doc_ids[:LONG]), list(doc_ids[:LONG])
    for step in range(3):
        assert m.accept_token(doc_ids[LONG + step])
        path_m.append(doc_ids[LONG + step])
        t = comma if step % 2 == 0 else d7
        assert f.accept_token(t)
        path_f.append(t)
        np.testing.assert_array_equal(_row(f), _row(_replay(backend, compiled, path_f)))
        np.testing.assert_array_equal(_row(m), _row(_replay(backend, compiled, path_m)))
    f.rollback(2)
    np.testing.assert_array_equal(_row(f), _row(_replay(backend, compiled, path_f[:-2])))
    if name != "outlines":
        # each switch moved the library matcher by the views' distance (<= 6), never LONG
        assert m._shared.moves - moves_before <= 7 * 6 and m._shared.copies == 0


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_far_apart_views_detach_once(name, tok, doc_ids):
    """A fork left behind while its origin accepts more than detach_after tokens gets its own
    library copy the first time it is used (one copy, not a replay on every switch), and both
    still fill the rows of their paths."""
    backend = _backend(name, tok, max_rollback_tokens=8)
    compiled = backend.compile(INT_ARRAY)
    m = backend.matcher(compiled)
    m.accept_tokens(doc_ids[:100])
    f = m.fork()
    assert m.accept_tokens(doc_ids[100:400]) == 300
    shared = m._shared
    row_f = _row(f)  # moves the library matcher back 300 tokens, then detaches f
    assert f._shared is not shared and shared.copies == 1
    np.testing.assert_array_equal(row_f, _row(_replay(backend, compiled, doc_ids[:100])))
    for _ in range(3):  # switching is free from now on
        moves = shared.moves
        np.testing.assert_array_equal(_row(m), _row(_replay(backend, compiled, doc_ids[:400])))
        _row(f)
        assert shared.moves - moves <= 300
    f.rollback(5)  # the detached copy keeps the tokens it needs to roll back
    np.testing.assert_array_equal(_row(f), _row(_replay(backend, compiled, doc_ids[:95])))


def test_parallel_llguidance_fill_makes_no_library_copies(tok, doc_ids):
    """llguidance's multi-request fill on threads walks each request's own library matcher
    (consume / rollback, branches included) instead of copying it per branch: no library copy
    is made in any step, and the rows equal each request's own fill."""
    pytest.importorskip("llguidance")
    backend = get_backend("llguidance", tok, num_threads=2)
    compiled = backend.compile(INT_ARRAY)
    ms = [backend.matcher(compiled) for _ in range(2)]
    for m in ms:
        m.accept_tokens(doc_ids[:LONG])
    before = [m._shared.copies for m in ms]
    for step in range(3):
        tree = _tree(tok, doc_ids[LONG + step - 1])
        assert any(len(tree.children(k)) > 1 for k in range(tree.num_nodes))  # it branches
        n = tree.num_nodes
        rows = allocate_token_bitmask(2 * n, backend.vocab_size)
        valids = backend.fill_tree_bitmasks([(ms[0], tree, 0), (ms[1], tree, n)], rows)
        for j, m in enumerate(ms):
            one = allocate_token_bitmask(n, backend.vocab_size)
            assert m.fill_tree_bitmask(tree, one).tolist() == valids[j].tolist()
            np.testing.assert_array_equal(rows[j * n : (j + 1) * n].numpy(), one.numpy())
        assert [m._shared.copies for m in ms] == before
        for m in ms:
            assert m.accept_token(doc_ids[LONG + step])


@pytest.mark.parametrize("name", BACKENDS)
def test_forced_tokens_of_a_long_forced_run_are_capped(name, tok):
    """Grammars forcing 80 and 600 characters: forced_tokens() returns max_forced_tokens
    tokens where the grammar forces more (with control characters, every backend finds them:
    one token each), each accepted in turn by a fresh matcher, spelling a prefix of the forced
    text, and the matcher is unchanged."""
    backend = _backend(name, tok, max_forced_tokens=5)
    info = backend.tokenizer_info
    for pattern, text, expect in [
        ("(\x01\x02){40}", b"\x01\x02" * 40, 5),
        ("(hello world ){50}", b"hello world " * 50, 0 if name == "outlines" else 5),
    ]:
        compiled = backend.compile(Regex(pattern))
        m = backend.matcher(compiled)
        forced = m.forced_tokens()
        assert len(forced) == expect, (pattern, forced)  # outlines: one token per row only
        assert text.startswith(b"".join(info.token_bytes[t] for t in forced))
        assert backend.matcher(compiled).accept_tokens(forced) == len(forced)
        assert m.num_accepted == 0 and m.forced_tokens() == forced


def test_max_forced_tokens_is_checked(tok):
    with pytest.raises(ValueError, match="max_forced_tokens"):
        get_backend("xgrammar", tok, max_forced_tokens=-1)


def test_outlines_refuses_an_index_estimated_too_large(tok):
    """The schema in docs/architecture.md (an array of <= 50 strings of <= 200 characters: 6.3 GB and 38 s
    to build) is refused at once with a typed error naming the limit; a smaller limit refuses
    a small schema the default lets through, which then compiles and works."""
    pytest.importorskip("outlines_core")
    backend = get_backend("outlines", tok)
    big = JsonSchema(
        {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 50}
    )
    with pytest.raises(GrammarLimitError, match="max_index_(bytes|states)"):
        backend.compile(big)
    ten = JsonSchema(
        {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 10}
    )
    with pytest.raises(GrammarLimitError, match="max_index_bytes"):
        backend.compile(ten)
    with pytest.raises(GrammarLimitError, match="max_index_states"):
        backend.compile(Regex("a{100000000}"))
    small = JsonSchema(
        {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}
    )
    tight = get_backend("outlines", tok, max_index_bytes=1 << 20)
    with pytest.raises(GrammarLimitError):
        tight.compile(small)
    m = backend.matcher(backend.compile(small))
    assert m.accept_tokens(tok.encode('["ab", "cd"]')) > 0


def test_outlines_refuses_a_regex_too_long_to_measure_at_once(tok):
    """An object of 500 optional properties is a 9.7 MiB outlines regex: measuring its index
    took 34 s of a loaded host before any library work. Refused in well under a second, naming
    max_regex_bytes; a real schema's regex (the sample's longest, 0.8 MB) is under the default."""
    pytest.importorskip("outlines_core")
    from outlines_core.json_schema import build_regex_from_schema

    backend = get_backend("outlines", tok)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    t0 = time.perf_counter()
    with pytest.raises(GrammarLimitError, match="max_regex_bytes"):
        backend.compile(JsonSchema(wide))
    assert time.perf_counter() - t0 < 5
    longest = max(
        len(build_regex_from_schema(json.dumps(r["schema"])))
        for r in jsonschemabench_sample()
        if r["id"] in ("wp_11_Normalized", "wp_33_Normalized")
    )
    assert 500_000 < longest < backend.max_regex_bytes


def test_llguidance_parser_limits_refuse_with_a_typed_error(tok):
    pytest.importorskip("llguidance")
    schema = JsonSchema(
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 300}}}
    )
    tight = get_backend("llguidance", tok, parser_limits={"initial_lexer_fuel": 1000})
    with pytest.raises(GrammarLimitError, match="parser limits"):
        tight.compile(schema)
    assert get_backend("llguidance", tok).compile(schema) is not None


_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON, PERSON_COMPACT = JsonSchema(_PERSON), JsonSchema(_PERSON, whitespace="compact")

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from spec_grammar.models import load_tokenizer
    from spec_grammar.registry import get_backend
    from spec_grammar.specs import JsonSchema, Regex
    from spec_grammar.errors import SpecGrammarError
    from spec_grammar.worker.drafters.forced import GrammarDraft, extend_with_forced

    def vm_bytes():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

    tok = load_tokenizer("smollm2")
    name = sys.argv[1]
    backend = get_backend(name, tok, compile_timeout_s=60)
    cap = vm_bytes() + int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type":
              "integer"}}, "required": ["name", "age"], "additionalProperties": False}
    requests = {
        "person": JsonSchema(person),
        "huge_repeat": Regex("a{100000000}"),
        "const_1mb": JsonSchema({"const": "ab" * 500000}),
        "person_again": JsonSchema(person, whitespace="compact"),
    }
    out = {}
    for rid, spec in requests.items():
        try:
            compiled = backend.compile(spec)
            draft = GrammarDraft(tokens=[tok.eos_token_id], parents=[-1], terminated=[False])
            added = extend_with_forced(draft, lambda n: backend.matcher(compiled), budget=8)
            fresh = backend.matcher(compiled)
            out[rid] = {"forced": draft.tokens[1:], "accepted": fresh.accept_tokens(draft.tokens[1:]),
                        "added": added}
        except SpecGrammarError as e:
            out[rid] = {"error": type(e).__name__}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_long_forced_runs_and_huge_grammars_under_a_memory_cap(name, tok):
    """A child process, its address space capped at 1.5 GiB above what it uses after loading
    the tokenizer, drafts forced tokens (the worker's ``extend_with_forced``) for a batch with
    two grammars forcing enormous runs (``a{100000000}``: xgrammar's jump-forward alone would
    take ~7 GB; a 1 MB const) between two ordinary requests. It must finish with every request
    either drafted (forced tokens a fresh matcher accepts) or refused with a typed error, and
    the ordinary requests drafted as before (their forced key text)."""
    pytest.importorskip({"outlines": "outlines_core"}.get(name, name))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, name, str(3 << 29)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for rid, r in out.items():
        if "error" in r:  # a typed refusal of that request only (outlines: its index limits)
            assert rid in ("huge_repeat", "const_1mb"), (rid, r)
            assert r["error"] in ("GrammarLimitError", "GrammarStateError"), r
        else:
            assert r["accepted"] == len(r["forced"]) <= 8, (rid, r)
    backend = get_backend(name, tok)
    for rid, spec in (("person", PERSON), ("person_again", PERSON_COMPACT)):
        want = backend.matcher(backend.compile(spec)).forced_tokens()[:8]
        assert out[rid]["forced"] == want, rid


def test_regex_estimates_count_the_unrolled_pattern_without_unrolling_it():
    """A counted repetition counts as its copies written out (the same positions as the
    unrolled pattern, which Python's parser also reads); the forced bound counts only the
    minimum copies plus one; unreadable patterns give None; a huge count costs nothing."""
    from spec_grammar.limits import regex_forced_bound, regex_positions

    for short, unrolled in [
        ("(ab){3}", "ababab"),
        ("x[0-9]{2}y?", "x[0-9][0-9]y?"),
        ("a|bc", "a|bc"),
    ]:
        assert (
            regex_positions(short)
            == regex_positions(unrolled)
            == len(unrolled.replace("[0-9]", "d").replace("?", "").replace("|", ""))
        )
    assert regex_positions("[^a]{4}", wide_only=True) == 4
    assert regex_positions("[a-c]{4}", wide_only=True) == 0
    assert regex_forced_bound("(ab){2,9}") == 6  # 2 copies forced, plus one entered partway
    assert regex_forced_bound("a|bcd") == 3
    assert regex_positions("a{100000000}") == 100_000_000
    assert regex_positions("(?<name>a)") is None  # not Python syntax: no estimate
