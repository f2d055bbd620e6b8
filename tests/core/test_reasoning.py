"""ReasoningGrammar on every backend, against a replay oracle: a fresh inner matcher fed only
the tokens after the marker, and a fresh wrapper fed each draft-tree path."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import check_tree_against_replay, row_of

from spec_grammar import (
    GrammarStateError,
    JsonSchema,
    get_backend,
)
from spec_grammar.errors import GrammarSpecError
from spec_grammar.reasoning import ReasoningGrammar
from spec_grammar.vocab import encode_ids

BACKENDS = ["xgrammar", "llguidance", "outlines"]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
MARKER = "</think>"
DOC = json.dumps({"answer": 42})


@pytest.fixture(scope="module", params=BACKENDS)
def grammar(request, tok):
    backend = get_backend(request.param, tok)
    return backend, backend.compile(JsonSchema(SCHEMA))


def make(grammar, **kw):
    backend, compiled = grammar
    return ReasoningGrammar(backend.matcher(compiled), MARKER, **kw)


def free_row(info):
    """The oracle's reasoning row: every tokenizer id except the stop tokens."""
    allowed = np.ones(info.vocab_size, dtype=bool)
    allowed[info.tokenizer_vocab_size :] = False
    allowed[list(info.stop_token_ids)] = False
    return (
        np.packbits(np.pad(allowed, (0, -len(allowed) % 32)).reshape(-1, 32)[:, ::-1], axis=1)
        .view(">u4")
        .astype(np.uint32)
        .view(np.int32)[:, 0]
    )


def oracle_row(grammar, reasoning_ids, after):
    """Row after ``reasoning_ids`` (which end with the marker) + ``after``, from a fresh inner
    matcher that never sees the reasoning."""
    backend, compiled = grammar
    inner = backend.matcher(compiled)
    assert inner.accept_tokens(after) == len(after)
    return row_of(inner)


def spellings(tok):
    """The marker as the tokenizer writes it, and byte by byte (one token per byte)."""
    canonical = encode_ids(tok, MARKER)
    info_bytes = {b: i for i, b in enumerate(_token_bytes(tok)) if len(b) == 1}
    by_byte = [info_bytes[bytes([c])] for c in MARKER.encode()]
    assert canonical != by_byte
    return [canonical, by_byte]


def _token_bytes(tok):
    from spec_grammar.tokenizer_info import TokenizerInfo

    return TokenizerInfo.from_huggingface(tok).token_bytes


def test_marker_in_any_spelling_hands_over_to_the_grammar(grammar, tok):
    think = encode_ids(tok, "Let me think: 6 times 7 is 42.")
    doc = encode_ids(tok, DOC)
    for marker_ids in spellings(tok):
        m = make(grammar)
        info = m.info
        for t in think + marker_ids[:-1]:
            assert m.in_reasoning
            assert (row_of(m) == free_row(info)).all()
            assert m.accept_token(t)
        assert m.accept_token(marker_ids[-1])
        assert m.reasoning_length == len(think) + len(marker_ids)
        for k in range(len(doc) + 1):
            assert (row_of(m) == oracle_row(grammar, None, doc[:k])).all()
            if k < len(doc):
                assert m.accept_token(doc[k])
        assert m.accept_token(info.stop_token_ids[0])
        assert m.is_terminated()


def test_stop_tokens_are_refused_while_reasoning_and_marker_split_in_a_token_does_not_count(
    grammar, tok
):
    m = make(grammar)
    eos = m.info.stop_token_ids[0]
    assert not m.accept_token(eos)
    # a token holding the marker followed by more text does not end reasoning
    tb = m.info.token_bytes
    joined = [i for i, b in enumerate(tb) if b.startswith(b">") and len(b) > 1][0]
    ids = encode_ids(tok, "</think")
    assert m.accept_tokens(ids + [joined]) == len(ids) + 1
    assert m.in_reasoning


def test_rollback_across_the_marker_restores_reasoning(grammar, tok):
    think = encode_ids(tok, "ok")
    marker = encode_ids(tok, MARKER)
    doc = encode_ids(tok, DOC)
    seq = think + marker + doc
    m = make(grammar)
    assert m.accept_tokens(seq) == len(seq)
    for k in range(1, len(seq) + 1):
        f = m.fork()
        f.rollback(k)
        fresh = make(grammar)
        assert fresh.accept_tokens(seq[: len(seq) - k]) == len(seq) - k
        assert f.in_reasoning == fresh.in_reasoning
        assert (row_of(f) == row_of(fresh)).all()
        assert f.accept_tokens(seq[len(seq) - k :]) == k  # and forward again
    with pytest.raises(GrammarStateError):
        m.rollback(m.max_rollback_tokens + 1)


def test_budget_forces_the_marker(grammar, tok):
    m = make(grammar, max_reasoning_tokens=3)
    marker = list(m.end_marker_ids)
    assert m.accept_tokens(encode_ids(tok, "a b c d")[:3]) == 3
    assert m.forced_tokens() == marker
    row = row_of(m)
    assert np.count_nonzero(row) == 1
    assert not m.accept_token(encode_ids(tok, " e")[0])
    assert m.accept_tokens(marker) == len(marker)
    assert not m.in_reasoning
    assert m.forced_tokens() == m.inner.forced_tokens()


def test_bad_markers_are_typed_errors(grammar):
    backend, compiled = grammar
    for bad in ("", [], [-1], [backend.vocab_size + 5]):
        with pytest.raises(GrammarSpecError):
            ReasoningGrammar(backend.matcher(compiled), bad)
    with pytest.raises(GrammarSpecError, match="max_reasoning_tokens"):
        ReasoningGrammar(backend.matcher(compiled), MARKER, max_reasoning_tokens=-1)
    used = backend.matcher(compiled)
    used.accept_tokens([used.info.token_bytes.index(b"{")])
    with pytest.raises(GrammarSpecError, match="fresh"):
        ReasoningGrammar(used, MARKER)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_tree_rows_straddling_the_marker_equal_replay(grammar, tok, data):
    """Random draft trees over a pool of marker pieces, JSON pieces, stop and stray tokens,
    from random reasoning prefixes (before, inside and after the marker): every row and valid
    flag equals a fresh wrapper replaying that node's path."""
    think = encode_ids(tok, "hmm")
    marker = encode_ids(tok, MARKER)
    doc = encode_ids(tok, DOC)
    full = think + marker + doc
    pool = sorted(set(full) | {tok.eos_token_id, encode_ids(tok, "x")[0]})
    prefix = full[: data.draw(st.integers(0, len(full) - 1), label="prefix")]
    rest = full[len(prefix) :]
    # a chain continuing the sequence (so the marker is crossed inside the tree), then random
    # branches anywhere
    chain = data.draw(st.integers(0, min(len(rest), 8)), label="chain")
    n = chain + 1 + data.draw(st.integers(0, 8), label="branches")
    parents = (
        [-1] + list(range(chain)) + [data.draw(st.integers(0, i - 1)) for i in range(chain + 1, n)]
    )
    tokens = [0] + rest[:chain] + [data.draw(st.sampled_from(pool)) for _ in range(chain + 1, n)]
    check_tree_against_replay(lambda: make(grammar), prefix, tokens, parents)


def test_marker_holding_a_stop_token_or_a_bad_budget_is_refused(grammar, tok):
    backend, compiled = grammar
    eos = tok.eos_token_id
    for marker in ([eos], tok.convert_ids_to_tokens(eos)):
        with pytest.raises(GrammarSpecError, match="stop token"):
            ReasoningGrammar(backend.matcher(compiled), marker)
    for budget in (2.7, "3", True, float("inf")):
        with pytest.raises(GrammarSpecError, match="max_reasoning_tokens"):
            ReasoningGrammar(backend.matcher(compiled), MARKER, max_reasoning_tokens=budget)


def test_forced_marker_stops_where_the_marker_completes(grammar, tok):
    """A marker whose start repeats at its end: the text before the budget may already hold
    its first part, and forcing stops at the token that completes it."""
    backend, compiled = grammar
    m = ReasoningGrammar(backend.matcher(compiled), "END END", max_reasoning_tokens=2)
    assert m.accept_tokens(encode_ids(tok, "END ")[:2]) == 2
    forced = m.forced_tokens()
    assert m.accept_tokens(forced) == len(forced) and not m.in_reasoning
