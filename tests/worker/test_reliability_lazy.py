"""Attacks on lazy greedy verification (``verify_greedy_batch`` with ``GreedyRequest.matcher`` / ``pre_accepted``,
``pre_accept_first_branch``) and on the worker's lazy steps (``lazy_grammar=True``).

Oracles: the per-request path ``fill_tree_bitmask`` + ``process_tree_logits`` +
``verify_greedy`` on a fresh matcher (the module's contract), a fresh matcher fed the committed
run (the lazy matcher must end exactly there), and plain constrained decoding (``no_spec``) of
the real SmolLM2 (float64) for the worker. Real xgrammar / llguidance / outlines-core backends
over the SmolLM2 tokenizer, some with a model head 100 ids wider than the tokenizer (padding
ids in trees and as greedy tokens); hostile trees (duplicate siblings, stop tokens with
children, ids outside the vocabulary), NaN / +inf / all ``-inf`` rows, grammars that end early.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from faults import FaultyMatcher
from oracles import oracle_verify, state_error
from spec_grammar_xgrammar import XGrammarBackend, XGrammarMatcher

from spec_grammar import JsonSchema, Regex, get_backend
from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from spec_grammar.errors import GrammarStateError
from spec_grammar.models import load_tokenizer
from spec_grammar.tree import DraftTree
from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.batch_verify import (
    GreedyRequest,
    launch_masked_rows,
    pre_accept_first_branch,
    verify_greedy_batch,
)
from spec_grammar.worker.drafters import Drafter
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy

EXTRA = 100  # padding ids of a model head wider than the tokenizer
SPECS = [
    (Regex(r"(yes|no)"), "yes"),  # ends after one or two tokens
    (Regex(r"[a-z]+( [a-z]+)*"), "hello big world and the sea is blue today"),
    (
        JsonSchema(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            }
        ),
        '{"a": 12, "b": true}',
    ),
]
WORDS = Regex(r"[a-z]+( [a-z]+)*")


@functools.cache
def _tok():
    return load_tokenizer("smollm2")


@functools.cache
def _setup(name: str, extra: int = EXTRA, max_rollback: int = 256):
    """Backend, and per spec its compiled grammar and document (+ the stop token)."""
    tok = _tok()
    backend = get_backend(name, tok, vocab_size=len(tok) + extra, max_rollback_tokens=max_rollback)
    stop = backend.tokenizer_info.stop_token_ids[0]
    docs = [
        (backend.compile(s), list(tok.encode(d, add_special_tokens=False)) + [stop])
        for s, d in SPECS
    ]
    return backend, docs, stop


def _matcher_at(setup, spec: int, pos: int):
    backend, docs, _ = setup
    compiled, doc = docs[spec]
    m = backend.matcher(compiled)
    assert m.accept_tokens(doc[:pos]) == pos
    return m


def _hostile_tree(rng: random.Random, setup, doc: list[int], pos: int, n: int) -> DraftTree:
    """A first branch along the document, then mostly the document's next token, else stop
    tokens (with children below), padding ids,
    ids outside ``[0, V)``, duplicates of earlier tokens (duplicate siblings) or any id."""
    backend, _, stop = setup
    v, n_tok = backend.vocab_size, backend.tokenizer_info.tokenizer_vocab_size
    tokens, parents, depth = [doc[pos - 1] if pos else 0], [-1], [0]
    spine = min(rng.randint(0, 4), n - 1, len(doc) - pos)  # a first branch along the document
    for d in range(1, spine + 1):
        tokens.append(doc[pos + d - 1])
        parents.append(d - 1)
        depth.append(d)
    for _ in range(1 + spine, n):
        p = rng.randrange(len(tokens))
        d = depth[p] + 1
        r = rng.random()
        if r < 0.5 and pos + d - 1 < len(doc):
            t = doc[pos + d - 1]
        elif r < 0.6:
            t = stop
        elif r < 0.7:
            t = rng.randrange(n_tok, v)
        elif r < 0.75:
            t = rng.choice([-1, v, v + 5])
        elif r < 0.85 and len(tokens) > 1:
            t = tokens[rng.randrange(1, len(tokens))]
        else:
            t = rng.randrange(v)
        tokens.append(t)
        parents.append(p)
        depth.append(d)
    return DraftTree(tokens, parents)


def _hostile_logits(
    rng: random.Random, setup, tree: DraftTree, doc: list[int], pos: int, n_max: int
):
    """Low-resolution noise (ties) with, per row, the document's token on top (in half or 90% of
    the rows), else a padding id, the stop token, any id, a NaN / +inf maximum, all ``-inf``, or
    one finite logit only."""
    backend, _, stop = setup
    v, n_tok = backend.vocab_size, backend.tokenizer_info.tokenizer_vocab_size
    x = torch.randint(
        -3, 4, (n_max, v), generator=torch.Generator().manual_seed(rng.randrange(2**31))
    ).float()
    agree = rng.choice([0.5, 0.9])
    for k in range(tree.num_nodes):
        p = pos + tree.depth_list[k]
        if rng.random() < agree:
            if p < len(doc):
                x[k, doc[p]] = 9.0
            continue
        r = rng.random()
        if r < 0.2:
            x[k, rng.randrange(n_tok, v)] = 9.0
        elif r < 0.3:
            x[k, stop] = 9.0
        elif r < 0.5:
            x[k, rng.randrange(v)] = 9.0
        elif r < 0.6:
            x[k, rng.randrange(v)] = rng.choice([float("nan"), float("inf")])
        elif r < 0.7:
            x[k] = float("-inf")
        elif r < 0.85:
            x[k] = float("-inf")
            x[k, rng.randrange(n_tok, v) if r < 0.75 else rng.randrange(v)] = 1.0
    return x


def _oracle(setup, logits, tree, spec, pos, stops):
    return oracle_verify(_matcher_at(setup, spec, pos), logits, tree, stops)


def _state_error(setup, m, spec: int, pos: int, run: list[int]) -> str | None:
    """None when ``m`` is where a fresh matcher fed the document prefix and ``run`` is."""
    return state_error(m, _matcher_at(setup, spec, pos), run)


def _plain(result):
    return type(result) if isinstance(result, GrammarStateError) else result


@pytest.mark.parametrize("block", range(3))
# xgrammar in the unit lane; the other two backends (seconds each) in the integration lane
@pytest.mark.parametrize(
    "name",
    [
        "xgrammar",
        *(pytest.param(n, marks=pytest.mark.integration) for n in ("llguidance", "outlines")),
    ],
)
def test_lazy_walks_on_hostile_trees_equal_the_oracle(name, block):
    """Batches of lazy (with or without the first branch pre-accepted), filled (with or
    without early masked rows) and plain requests of different tree sizes; stop sets with the grammar's
    stop token, without it
    (the grammar terminates inside a walk) or with an extra one."""
    setup = _setup(name)
    backend, docs, stop = setup
    failures = []
    for seed in range(block * 15, block * 15 + 15):
        rng = random.Random(seed)
        b = rng.randint(1, 4)
        specs = [rng.randrange(len(docs)) for _ in range(b)]
        positions = [rng.randrange(len(docs[s][1]) + 1) for s in specs]
        trees = [
            _hostile_tree(rng, setup, docs[s][1], p, rng.randint(1, 9))
            for s, p in zip(specs, positions)
        ]
        n_max = max(t.num_nodes for t in trees) + rng.randint(0, 2)
        logits = torch.stack(
            [
                _hostile_logits(rng, setup, t, docs[s][1], p, n_max)
                for t, s, p in zip(trees, specs, positions)
            ]
        )
        stopsets = [rng.choice([{stop}, set(), {stop, 0}]) for _ in range(b)]
        kinds = [rng.choice(["lazy", "lazy", "lazy", "filled", "plain"]) for _ in range(b)]
        matchers, pre, offsets, valids, parts, rows = [], [], [], [], [], 0
        for k in range(b):
            m = _matcher_at(setup, specs[k], positions[k])
            if kinds[k] == "filled" and m.is_terminated():
                kinds[k] = "plain"
            matchers.append(m if kinds[k] == "lazy" else None)
            ahead = kinds[k] == "lazy" and not m.is_terminated() and rng.random() < 0.6
            pre.append(pre_accept_first_branch(m, trees[k]) if ahead else [])
            if kinds[k] == "filled":
                part = allocate_token_bitmask(trees[k].num_nodes, backend.vocab_size)
                valids.append(m.fill_tree_bitmask(trees[k], part))
                parts.append(part)
                offsets.append(rows)
                rows += trees[k].num_nodes
            else:
                valids.append(None)
                offsets.append(None)
        bitmask = torch.cat(parts) if parts else None
        # the filled rows masked while the forward ran (EarlyMask), for some batches
        early = (
            launch_masked_rows(logits, bitmask, trees, offsets)
            if parts and rng.random() < 0.5
            else None
        )
        requests = [
            GreedyRequest(k, offsets[k], valids[k], stopsets[k], matchers[k], pre[k])
            for k in range(b)
        ]
        got, _ = verify_greedy_batch(logits, trees, requests, bitmask=bitmask, masked_rows=early)
        for k in range(b):
            tree = trees[k]
            if kinds[k] == "plain":
                processed = process_tree_logits(
                    logits[k, : tree.num_nodes], tree, [0], SamplingParams()
                )
                try:
                    want = verify_greedy(processed, tree, stop_token_ids=stopsets[k])
                except GrammarStateError:
                    want = GrammarStateError
            else:
                want = _oracle(
                    setup, logits[k, : tree.num_nodes], tree, specs[k], positions[k], stopsets[k]
                )
            if _plain(got[k]) != want:
                failures.append((seed, k, kinds[k], got[k], want))
            elif kinds[k] == "lazy" and isinstance(got[k], tuple):
                run = [tree.token_list[n] for n in got[k][0][1:]] + [got[k][1]]
                err = _state_error(setup, matchers[k], specs[k], positions[k], run)
                if err:
                    failures.append((seed, k, "state", run, err))
    assert not failures, failures


class _FillFaultMatcher(XGrammarMatcher):
    """A real xgrammar matcher whose single-row fill (the lazy walk's) raises."""

    fills = 0

    def _fill_next_token_bitmask(self, bitmask, row):
        self.fills += 1
        raise RuntimeError("injected fault in fill_next_token_bitmask")


ACCEPT_FAULT = Regex(r"[a-z ]+")


class _FillFaultBackend(XGrammarBackend):
    """xgrammar whose :data:`WORDS` matchers fail their lazy row fills and whose
    :data:`ACCEPT_FAULT` matchers fail their 4th accept."""

    def _matcher(self, compiled):
        m = super()._matcher(compiled)
        if compiled.spec == ACCEPT_FAULT:
            return FaultyMatcher(self, m._m, fail_accept_at=4)
        return _FillFaultMatcher(self, m._m) if compiled.spec == WORDS else m


@pytest.mark.parametrize("row", ["root", "child"])
def test_a_failing_row_fill_ends_the_lazy_walk_with_its_error(row):
    """The grammar's fill of the refused row raises: that request ends with the fault (at a
    child row it used to be read as a dead row: the walk committed the child's token as the
    bonus and went on), and the other lazy request of the batch is decided as its oracle."""
    tok = _tok()
    backend = _FillFaultBackend(tok)
    v, stop = backend.vocab_size, backend.tokenizer_info.stop_token_ids[0]
    words = list(tok.encode("hello big world", add_special_tokens=False))
    tree = DraftTree([0, words[0], words[1]], [-1, 0, 1])
    logits = torch.zeros(2, 3, v)
    logits[:, 0, words[0]] = logits[:, 1, words[1]] = logits[:, 2, words[2]] = 5.0
    logits[0, 0 if row == "root" else 2, 7] = 9.0  # a token [a-z ] forbids
    logits[1, 2, 7] = 9.0
    bad = backend.matcher(backend.compile(WORDS))
    good_setup = _setup("xgrammar", 0)
    good = _matcher_at(good_setup, 1, 0)
    got, _ = verify_greedy_batch(
        logits,
        [tree, tree],
        [
            GreedyRequest(
                i, stop_token_ids={stop}, matcher=m, pre_accepted=pre_accept_first_branch(m, tree)
            )
            for i, m in enumerate([bad, good])
        ],
    )
    assert isinstance(got[0], GrammarStateError) and "injected fault" in str(got[0]), got[0]
    assert bad.fills == 1
    assert got[1] == _oracle(good_setup, logits[1], tree, 1, 0, {stop})
    run = [tree.token_list[n] for n in got[1][0][1:]] + [got[1][1]]
    assert _state_error(good_setup, good, 1, 0, run) is None


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_a_grammar_terminated_inside_a_walk_gives_a_dead_row_not_an_error(name):
    """Without the grammar's stop token among the walk's stops, the walk enters its node and the
    grammar terminates there: that row allows nothing (the row fill of a terminated matcher is
    not a fault), so the stop token is the bonus, as the oracle's dead child."""
    setup = _setup(name)
    backend, docs, stop = setup
    yes = docs[0][1][0]
    tree = DraftTree([0, yes, stop, 7], [-1, 0, 1, 2])
    logits = torch.zeros(1, 4, backend.vocab_size)
    logits[0, 0, yes] = logits[0, 1, stop] = logits[0, 2, 7] = logits[0, 3, 8] = 5.0
    for pre in (False, True):
        m = _matcher_at(setup, 0, 0)
        ahead = pre_accept_first_branch(m, tree) if pre else ()
        got, _ = verify_greedy_batch(
            logits, [tree], [GreedyRequest(0, matcher=m, pre_accepted=ahead)]
        )
        assert got[0] == _oracle(setup, logits[0], tree, 0, 0, set()) == ([0, 1], stop)
        assert m.is_terminated() and _state_error(setup, m, 0, 0, [yes, stop]) is None


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
@pytest.mark.parametrize("max_rollback", [0, 2])
def test_the_pre_accepted_branch_stays_within_the_rollback_depth(name, max_rollback):
    """A first branch deeper than the matcher's ``max_rollback_tokens``, with the greedy path
    leaving it at the root: the walk must roll all of it back. It used to raise "rollback(5)
    exceeds max_rollback_tokens" where the tree fill oracle verifies fine."""
    setup = _setup(name, 0, max_rollback)
    backend, docs, stop = setup
    doc = docs[1][1]
    tree = DraftTree.chain(0, doc[:5])
    logits = torch.zeros(1, tree.num_nodes, backend.vocab_size)
    other = _tok().encode("zebra", add_special_tokens=False)[0]
    logits[0, 0, other] = 5.0  # the greedy path leaves the first branch at the root
    logits[0, 0, 7] = 9.0  # ... after a forbidden token: its row is filled too
    m = _matcher_at(setup, 1, 0)
    pre = pre_accept_first_branch(m, tree)
    assert len(pre) <= max_rollback
    got, _ = verify_greedy_batch(
        logits, [tree], [GreedyRequest(0, stop_token_ids={stop}, matcher=m, pre_accepted=pre)]
    )
    assert got[0] == _oracle(setup, logits[0], tree, 1, 0, {stop}) == ([0], other)
    assert _state_error(setup, m, 1, 0, [other]) is None


# -- the worker end to end ---------------------------------------------------------------------
MAX_NEW = 16
PROMPTS = [
    ("Question: is the sky blue? Answer (yes or no):", Regex(r"(yes|no)"), {}),
    (
        "A JSON object with an integer a:",
        JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        {},
    ),
    ("the sea is", WORDS, {}),
    ("the sea is", WORDS, {"max_new_tokens": 5}),  # the budget cuts a run
    ("Once upon a time", None, {}),
    ("the sea is", WORDS, {"stop": ["a"]}),  # a stop string inside a run
    ("the sky is", WORDS, {"repetition_penalty": 1.3}),  # not lazy: its tree is filled, same step
]


def _requests(extra: list[tuple] = ()) -> list[Request]:
    tok = _tok()
    out = []
    for k, (text, spec, kw) in enumerate(list(PROMPTS) + list(extra)):
        params = SamplingParams(**{"max_new_tokens": MAX_NEW, **kw})
        out.append(Request(tok.encode(text), spec, params, rid=f"r{k}"))
    return out


@functools.cache
def _model():
    from real_model import model_and_tokenizer

    return model_and_tokenizer()[0]


def _run(reqs, backend=None, **options):
    backend = backend or get_backend("xgrammar", _tok())
    with SpecWorker(_model(), _tok(), backend=backend, **options) as worker:
        return worker.run(reqs), list(worker.step_stats)


@functools.cache
def _reference() -> dict[str, tuple[list[int], str]]:
    results, _ = _run(_requests(), no_spec=True)
    return {r.rid: (r.token_ids, r.finish_reason) for r in results}


class HostileDrafter(Drafter):
    """Trees around each request's plain-decoding continuation (then the stop token, then
    junk), in three shapes by step: the right chain running past the stop token with a stop
    sibling that has children; a wrong first branch (the walk rolls back all its pre-accepted
    tokens) before two duplicate siblings of the right token; the right chain broken by a wrong
    token, with ids outside the vocabulary as root children."""

    def __init__(self, continuations: dict[str, list[int]], vocab: int, stop: int):
        super().__init__(num_draft_tokens=12)
        self.continuations, self.vocab, self.stop = continuations, vocab, stop
        self.steps: dict[str, int] = {}
        self.junk = _tok().encode(" Zebra 42 {", add_special_tokens=False)

    def _grammar_junk(self, s, avoid: int) -> list[int]:
        """Three tokens the request's grammar accepts, the first one not ``avoid``: a wrong
        first branch that the matcher pre-accepts whole (the walk must roll it all back)."""
        if s.matcher is None or s.matcher.is_terminated():
            return self.junk[:3]
        m, out = s.matcher.fork(), []
        row = allocate_token_bitmask(1, self.vocab)
        for _ in range(3):
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(row)
            ids = [
                t
                for t in allowed_token_ids(row[0], self.vocab)
                if t != self.stop and not (t == avoid and not out)
            ]
            if not ids:
                break
            out.append(ids[len(ids) // 2])
            assert m.accept_tokens(out[-1:]) == 1
        return (out + self.junk)[:3]

    def propose(self, batch):
        out = []
        for s in batch:
            step = self.steps.get(s.rid, 0)
            self.steps[s.rid] = step + 1
            c = (self.continuations[s.rid][len(s.output_ids) :] + [self.stop] + self.junk)[:4]
            j = self._grammar_junk(s, c[0])
            if step % 3 == 0:
                tokens = [s.root_token] + c + [self.stop, j[0]]
                parents = [-1, 0, 1, 2, 3, 0, 5]
            elif step % 3 == 1:
                tokens = [s.root_token, j[0], j[1], j[2], c[0], c[0], c[1], c[2]]
                parents = [-1, 0, 1, 2, 0, 0, 5, 6]
            else:
                tokens = [s.root_token, c[0], c[1], j[1], c[2], c[3], -1, self.vocab + 3]
                parents = [-1, 0, 1, 2, 2, 4, 0, 0]
            out.append(DraftTree(tokens, parents))
        return out


@pytest.mark.model
@pytest.mark.parametrize("max_rollback", [256, 2])
def test_lazy_worker_equals_plain_decoding_under_hostile_drafts(max_rollback):
    """``lazy_grammar=True`` with hostile trees (and a matcher rollback depth of 2, below the
    trees' depth), one request cancelled after its second step: every other request gives the
    tokens and finish reason of plain decoding, the cancelled one a prefix of them."""
    tok = _tok()
    ref = _reference()
    backend = get_backend("xgrammar", tok, max_rollback_tokens=max_rollback)
    stop = backend.tokenizer_info.stop_token_ids[0]
    reqs = _requests([("the sea is", WORDS, {})])
    conts = {r.rid: ref.get(r.rid, ref["r2"])[0] for r in reqs}
    drafter = HostileDrafter(conts, backend.vocab_size, stop)
    cancelled = reqs[-1].rid

    def on_step(stats, states):
        if drafter.steps.get(cancelled) == 2 and any(
            s.rid == cancelled and not s.finished for s in states
        ):
            worker.cancel(cancelled)

    with SpecWorker(_model(), tok, backend=backend, draft=drafter, lazy_grammar=True) as worker:
        got = {r.rid: r for r in worker.run(reqs, on_step=on_step)}
        stats = list(worker.step_stats)
    assert any(s.lazy_requests for s in stats) and any(s.forbidden_rows for s in stats)
    for rid, (ids, reason) in ref.items():
        assert (got[rid].token_ids, got[rid].finish_reason) == (ids, reason), (rid, got[rid])
    c = got[cancelled]
    assert (
        c.finish_reason == "cancelled"
        and c.token_ids == ref["r2"][0][: c.num_tokens]
        and c.num_tokens > 0
    )


@pytest.mark.model
def test_a_lazy_row_fill_fault_ends_only_its_request():
    """A request whose matcher fails its lazy row fill ends at the first such fill with the
    fault, keeping the tokens committed before it (a prefix of plain decoding); the others give
    exactly the plain-decoding tokens."""
    tok = _tok()
    ref = _reference()
    backend = _FillFaultBackend(tok)
    reqs = _requests()[:5]
    reqs.append(
        Request(
            tok.encode("the sea is"),
            ACCEPT_FAULT,
            SamplingParams(max_new_tokens=MAX_NEW),
            rid="accept",
        )
    )
    results, stats = _run(reqs, backend, draft="ngram", num_draft_tokens=6, lazy_grammar=True)
    got = {r.rid: r for r in results}
    assert any(s.lazy_requests for s in stats)
    for rid in ("r2", "r3"):  # the WORDS requests: the model soon wants a token [a-z ] forbids
        r = got[rid]
        assert (
            r.finish_reason == "error" and "injected fault in fill_next_token_bitmask" in r.error
        ), r
        assert r.token_ids == ref[rid][0][: r.num_tokens]
    r = got["accept"]
    assert (
        r.finish_reason == "error"
        and "injected fault in accept_token" in r.error
        and r.num_tokens < 4
    ), r
    for rid in ("r0", "r1", "r4"):
        assert (got[rid].token_ids, got[rid].finish_reason) == ref[rid], rid
