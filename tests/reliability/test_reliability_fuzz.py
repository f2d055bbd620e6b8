"""Property-based fuzzing (hypothesis) of every backend on the real SmolLM2 tokenizer (64
padding columns).

1. Random interleavings of accept / accept_tokens / validate / rollback / fork / fill /
   fill_tree on up to four live matchers (forks of one another) against a replay oracle: a
   fresh matcher fed the same committed sequence must agree on every answer, mask row,
   termination and token count.
2. Random draft trees with random (partly steered) logits through the whole verify path
   (``SpecGrammar.fill_tree_bitmask`` -> ``process_tree_logits`` -> ``verify_greedy`` /
   ``verify_stochastic``): every committed run, cut at the first stop token as the worker
   does, is accepted by a fresh matcher.

CI runs a few examples per backend (derandomized, < 60 s in all); ``SPEC_GRAMMAR_LONG=1`` runs
``SPEC_GRAMMAR_FUZZ_EXAMPLES`` (default 300) random examples each.
"""

from __future__ import annotations

import os
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_grammar import get_backend
from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from spec_grammar.errors import GrammarStateError, InvalidTokenError
from spec_grammar.specs import Ebnf, JsonSchema, Regex
from spec_grammar.testing.fixtures import fixture_tokenizer as _fixture_tokenizer
from spec_grammar.tree import DraftTree
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy, verify_stochastic

# outlines fuzzes for seconds more than the others: its cases are in the integration lane
BACKENDS = (
    "xgrammar",
    "llguidance",
    pytest.param("outlines", marks=pytest.mark.integration),
)
LONG = bool(os.environ.get("SPEC_GRAMMAR_LONG"))
EXAMPLES = int(os.environ.get("SPEC_GRAMMAR_FUZZ_EXAMPLES", "300")) if LONG else 12
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=list(HealthCheck),
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
ARITH = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'


@cache
def backend(name: str):
    tok, width = _fixture_tokenizer("smollm2")
    return get_backend(name, tok, vocab_size=width, max_rollback_tokens=16)


@cache
def grammars(name: str):
    b = backend(name)
    specs = [JsonSchema(SCHEMA, whitespace="compact"), Regex(r"[a-z]{1,5}( [0-9]{1,3})?")]
    if b.capabilities.ebnf:
        specs.append(Ebnf(ARITH))
    return [b.compile(s) for s in specs]


class Oracle:
    """Fresh-matcher replay of committed sequences (rows cached per sequence)."""

    def __init__(self, b, compiled):
        self.b, self.compiled = b, compiled
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor | None, bool]] = {}

    def fresh(self, seq) -> object:
        m = self.b.matcher(self.compiled)
        assert m.accept_tokens(list(seq)) == len(seq), f"oracle cannot replay {list(seq)}"
        return m

    def state(self, seq) -> tuple[torch.Tensor | None, bool]:
        """(mask row or None when terminated, terminated)."""
        key = tuple(seq)
        if key not in self._rows:
            m = self.fresh(seq)
            row = None
            if not m.is_terminated():
                bm = allocate_token_bitmask(1, self.b.vocab_size)
                m.fill_next_token_bitmask(bm, 0)
                row = bm[0].clone()
            self._rows[key] = (row, m.is_terminated())
        return self._rows[key]

    def allowed(self, seq) -> list[int]:
        row, _ = self.state(seq)
        return [] if row is None else allowed_token_ids(row, self.b.vocab_size)


def draw_token(data, oracle: Oracle, seq, *, invalid_rate: float = 0.15) -> int:
    """Mostly an allowed token; otherwise -1, a padding column, an id >= V or any id."""
    allowed = oracle.allowed(seq)
    V, n_tok = oracle.b.vocab_size, oracle.b.tokenizer_info.tokenizer_vocab_size
    if allowed and data.draw(st.floats(0, 1)) >= invalid_rate:
        return data.draw(st.sampled_from(allowed))
    return data.draw(st.sampled_from([-1, n_tok, V - 1, V, data.draw(st.integers(0, n_tok - 1))]))


def draw_walk(data, oracle: Oracle, seq, max_len: int) -> list[int]:
    walk: list[int] = []
    for _ in range(data.draw(st.integers(1, max_len))):
        t = draw_token(data, oracle, seq + walk, invalid_rate=0.1)
        walk.append(t)
        if not (0 <= t < oracle.b.vocab_size) or t not in oracle.allowed(seq + walk[:-1]):
            break
        if oracle.state(seq + walk)[1]:
            break
    return walk


def draw_tree(data, oracle: Oracle, seq, root: int, max_nodes: int) -> DraftTree:
    """A random tree below ``root``: under a node the grammar can continue, mostly allowed
    tokens; under an invalid or terminating node, any id in ``[-1, V)``."""
    tokens, parents = [root], [-1]
    for _ in range(data.draw(st.integers(0, max_nodes - 1))):
        p = data.draw(st.integers(0, len(tokens) - 1))
        ctx = seq + [tokens[i] for i in _path(parents, p)]
        if _replayable(oracle, ctx) and not oracle.state(ctx)[1]:
            t = draw_token(data, oracle, ctx, invalid_rate=0.25)
        else:
            t = data.draw(st.integers(-1, oracle.b.vocab_size - 1))
        tokens.append(t)
        parents.append(p)
    return DraftTree(tokens, parents)


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _replayable(oracle: Oracle, seq) -> bool:
    """True when the grammar accepts every token of ``seq`` (out-of-range ids end it)."""
    return oracle.b.matcher(oracle.compiled).validate_tokens(list(seq)) == len(seq)


def check_tree(oracle: Oracle, m, seq, tree: DraftTree) -> None:
    b = oracle.b
    bm = allocate_token_bitmask(tree.num_nodes + 1, b.vocab_size)
    valid = m.fill_tree_bitmask(tree, bm, 1).tolist()
    stops = set(b.tokenizer_info.stop_token_ids)
    toks, parents = tree.token_list, tree.parent_list
    expect = [True] * tree.num_nodes
    for n in range(1, tree.num_nodes):
        p, t = parents[n], toks[n]
        path = [toks[i] for i in _path(parents, p)]
        expect[n] = (
            expect[p] and (p == 0 or toks[p] not in stops) and t in oracle.allowed(seq + path)
        )
        path_n = path + [t]
        if expect[n] and t not in stops:
            row, term = oracle.state(seq + path_n)
            assert not term and torch.equal(bm[1 + n], row), (
                f"row of node {n} (path {path_n}) differs from replay"
            )
        else:
            assert not bm[1 + n].any(), f"node {n} (invalid or stop) has a non-zero row"
    assert valid == expect
    row, _ = oracle.state(seq)
    assert torch.equal(bm[1], row), "root row differs from replay"


def check_same(oracle: Oracle, m, seq) -> None:
    row, term = oracle.state(seq)
    assert m.num_accepted == len(seq)
    assert m.is_terminated() == term
    if not term:
        bm = allocate_token_bitmask(1, oracle.b.vocab_size)
        m.fill_next_token_bitmask(bm, 0)
        assert torch.equal(bm[0], row), f"mask after {seq} differs from replay"


OPS = ("accept", "accept_tokens", "validate", "rollback", "fork", "fill", "fill_tree")


@pytest.mark.parametrize("name", BACKENDS)
def test_random_interleavings_match_replay(name):
    b = backend(name)
    compiled_list = grammars(name)

    @FUZZ
    @given(data=st.data())
    def run(data):
        compiled = data.draw(st.sampled_from(compiled_list))
        oracle = Oracle(b, compiled)
        live = [(b.matcher(compiled), [])]
        for _ in range(data.draw(st.integers(1, 25))):
            i = data.draw(st.integers(0, len(live) - 1))
            m, seq = live[i]
            op = data.draw(st.sampled_from(OPS))
            _, term = oracle.state(seq)
            if op == "accept":
                t = draw_token(data, oracle, seq)
                if not 0 <= t < b.vocab_size:
                    with pytest.raises(InvalidTokenError):
                        m.accept_token(t)
                else:
                    expect = not term and t in oracle.allowed(seq)
                    assert m.accept_token(t) is expect
                    if expect:
                        seq.append(t)
            elif op in ("accept_tokens", "validate"):
                walk = draw_walk(data, oracle, seq, 6)
                if any(not 0 <= t < b.vocab_size for t in walk) and op == "accept_tokens":
                    with pytest.raises(InvalidTokenError):
                        m.accept_tokens(walk)
                    continue
                fresh = oracle.fresh(seq)
                expect = fresh.validate_tokens(walk)
                if op == "validate":
                    assert m.validate_tokens(walk) == expect
                else:
                    assert m.accept_tokens(walk) == expect
                    seq.extend(walk[:expect])
            elif op == "rollback":
                k = data.draw(st.integers(0, min(len(seq), m.max_rollback_tokens)))
                m.rollback(k)
                del seq[len(seq) - k :]
            elif op == "fork" and len(live) < 4:
                live.append((m.fork(), list(seq)))
            elif op == "fill" and term:
                with pytest.raises(GrammarStateError):
                    m.fill_next_token_bitmask(allocate_token_bitmask(1, b.vocab_size), 0)
            elif op == "fill_tree" and not term:
                root = seq[-1] if seq else 1
                check_tree(oracle, m, seq, draw_tree(data, oracle, seq, root, 10))
            for mm, ss in live:
                check_same(oracle, mm, ss)

    run()


@pytest.mark.parametrize("name", BACKENDS)
def test_random_trees_through_verify_commit_valid_sequences(name):
    b = backend(name)
    compiled_list = grammars(name)
    stops = tuple(b.tokenizer_info.stop_token_ids)
    V = b.vocab_size

    @FUZZ
    @given(data=st.data())
    def run(data):
        compiled = data.draw(st.sampled_from(compiled_list))
        oracle = Oracle(b, compiled)
        m = b.matcher(compiled)
        prompt = [1, 9690]
        committed: list[int] = []
        for _ in range(data.draw(st.integers(1, 4))):  # a few verify steps on one request
            if m.is_terminated():
                break
            root = (prompt + committed)[-1]
            tree = draw_tree(data, oracle, committed, root, 12)
            bm = allocate_token_bitmask(tree.num_nodes, V)
            valid = m.fill_tree_bitmask(tree, bm)
            gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
            logits = torch.randn(tree.num_nodes, V, generator=gen) * data.draw(
                st.sampled_from([0.5, 3.0])
            )
            for n in range(1, tree.num_nodes):  # steer some parents towards their child's token
                t = tree.token_list[n]
                if 0 <= t < V and data.draw(st.booleans()):
                    logits[tree.parent_list[n], t] += 50.0
            temperature = data.draw(st.sampled_from([0.0, 0.0, 0.8, 1.5]))
            params = SamplingParams(
                temperature=temperature,
                top_k=data.draw(st.sampled_from([0, 5])),
                top_p=data.draw(st.sampled_from([1.0, 0.9])),
                repetition_penalty=data.draw(st.sampled_from([1.0, 1.3])),
            )
            processed = process_tree_logits(
                logits, tree, prompt + committed, params, bitmask=bm, prompt_len=len(prompt)
            )
            if temperature == 0:
                nodes, bonus = verify_greedy(processed, tree, valid, stop_token_ids=stops)
            else:
                nodes, bonus = verify_stochastic(processed, tree, gen, valid, stop_token_ids=stops)
            assert nodes[0] == 0 and all(tree.parent_list[c] == p for p, c in zip(nodes, nodes[1:]))
            run_tokens = [tree.token_list[n] for n in nodes[1:]] + [int(bonus)]
            for k, t in enumerate(run_tokens):  # the worker cuts the run at the first stop token
                if t in stops:
                    run_tokens = run_tokens[: k + 1]
                    break
            n_ok = m.accept_tokens(run_tokens)
            assert n_ok == len(run_tokens), (
                f"committed {run_tokens} refused at {n_ok} after {committed}"
            )
            committed += run_tokens
            fresh = oracle.fresh(committed)  # a fresh matcher accepts the whole committed sequence
            assert fresh.is_terminated() == m.is_terminated() == (committed[-1] in stops)

    run()
