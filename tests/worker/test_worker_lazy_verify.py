"""Lazy greedy verification (no tree fill: each walk asks its request's matcher for the greedy
tokens it reads) against the per-request oracle ``fill_tree_bitmask`` + ``process_tree_logits``
+ ``verify_greedy``, with real xgrammar matchers over the SmolLM2 tokenizer: random trees around
a valid document, logits that favour the document, forbidden tokens, stop tokens, NaN / +inf
maxima and dead rows; lazy, filled and grammar-free requests mixed in one batch. The matcher of
a lazy request must end exactly where a fresh matcher fed the committed run is, whether or not
its tree's first branch was accepted before the walk (as the worker does under the forward)."""

import functools
import json
import random

import pytest
import torch
from oracles import oracle_verify, state_error

from spec_grammar import JsonSchema, get_backend
from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import BitmaskError, GrammarStateError
from spec_grammar.models import load_tokenizer
from spec_grammar.tree import DraftTree
from spec_grammar.worker.batch_verify import (
    GreedyRequest,
    pre_accept_first_branch,
    verify_greedy_batch,
)
from spec_grammar.worker.sampling import SamplingParams, process_tree_logits
from spec_grammar.worker.verify import verify_greedy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "ok": True})


@functools.cache
def _setup():
    tok = load_tokenizer("smollm2")
    backend = get_backend("xgrammar", tok)
    compiled = backend.compile(JsonSchema(SCHEMA))
    stop = backend.tokenizer_info.stop_token_ids[0]
    doc = list(tok.encode(DOCUMENT, add_special_tokens=False)) + [stop]
    return backend, compiled, doc, stop


def _matcher_at(pos: int):
    backend, compiled, doc, _ = _setup()
    m = backend.matcher(compiled)
    assert m.accept_tokens(doc[:pos]) == pos
    return m


def _tree(rng: random.Random, doc: list[int], pos: int, n: int) -> DraftTree:
    """Node k's token: mostly the document's next token after its path (so walks go deep),
    else another document token or any id (mostly forbidden)."""
    tokens, parents, depth = [doc[pos - 1] if pos else 0], [-1], [0]
    for _ in range(1, n):
        p = rng.randrange(len(tokens))
        d = depth[p] + 1
        r = rng.random()
        t = (
            doc[pos + d - 1]
            if r < 0.6 and pos + d - 1 < len(doc)
            else rng.choice(doc)
            if r < 0.85
            else rng.randrange(49152)
        )
        tokens.append(t)
        parents.append(p)
        depth.append(d)
    return DraftTree(tokens, parents)


def _logits(
    rng: random.Random, tree: DraftTree, doc: list[int], pos: int, n_max: int, vocab: int
) -> torch.Tensor:
    """Low-resolution noise (ties) with the document's token on top in most rows; some rows
    want a random token, have a NaN / +inf maximum or are all -inf."""
    x = torch.randint(
        -3, 4, (n_max, vocab), generator=torch.Generator().manual_seed(rng.randrange(2**31))
    ).float()
    for k in range(tree.num_nodes):
        p = pos + tree.depth_list[k]
        r = rng.random()
        if r < 0.6 and p < len(doc):
            x[k, doc[p]] = 9.0
        elif r < 0.8:
            x[k, rng.randrange(vocab)] = 9.0  # a token the grammar most likely forbids
        elif r < 0.85:
            x[k, rng.randrange(vocab)] = rng.choice([float("nan"), float("inf")])
        elif r < 0.9:
            x[k] = float("-inf")
    return x


def _oracle(logits, tree, pos, stops):
    return oracle_verify(_matcher_at(pos), logits, tree, stops)


def _same_state(m, pos: int, run: list[int]) -> bool:
    """``m`` is where a fresh matcher fed the document prefix and ``run`` is."""
    return state_error(m, _matcher_at(pos), run) is None


@pytest.mark.parametrize("seed", range(30))
def test_lazy_walks_equal_the_per_request_oracle(seed):
    backend, _, doc, stop = _setup()
    rng = random.Random(seed)
    vocab = backend.vocab_size
    b = rng.randint(1, 4)
    positions = [rng.randrange(len(doc) + 1) for _ in range(b)]
    trees = [_tree(rng, doc, pos, rng.randint(1, 8)) for pos in positions]
    n_max = max(t.num_nodes for t in trees)
    logits = torch.stack(
        [_logits(rng, t, doc, pos, n_max, vocab) for t, pos in zip(trees, positions)]
    )
    # per request: lazy (its matcher), filled (bitmask rows) or no grammar
    kinds = [rng.choice(["lazy", "lazy", "filled", "plain"]) for _ in range(b)]
    matchers, pre, offsets, valids, parts, rows = [], [], [], [], [], 0
    for i, (tree, pos, kind) in enumerate(zip(trees, positions, kinds)):
        m = _matcher_at(pos)
        matchers.append(m if kind == "lazy" else None)
        ahead = kind == "lazy" and not m.is_terminated() and rng.random() < 0.5
        pre.append(pre_accept_first_branch(m, tree) if ahead else [])
        if kind == "filled" and not m.is_terminated():
            part = allocate_token_bitmask(tree.num_nodes, vocab)
            valids.append(m.fill_tree_bitmask(tree, part))
            parts.append(part)
            offsets.append(rows)
            rows += tree.num_nodes
        else:
            if kind == "filled":  # a terminated matcher has no rows to fill: verified as plain
                kinds[i] = "plain"
            valids.append(None)
            offsets.append(None)
    requests = [
        GreedyRequest(i, offsets[i], valids[i], {stop}, matchers[i], pre[i]) for i in range(b)
    ]
    got, stats = verify_greedy_batch(
        logits, trees, requests, bitmask=torch.cat(parts) if parts else None
    )
    assert sorted(stats.lazy_ms) == [i for i in range(b) if kinds[i] == "lazy"]
    for i in range(b):
        tree, pos = trees[i], positions[i]
        if kinds[i] == "plain":
            processed = process_tree_logits(
                logits[i, : tree.num_nodes], tree, [0], SamplingParams()
            )
            try:
                want = verify_greedy(processed, tree, stop_token_ids={stop})
            except GrammarStateError:
                want = GrammarStateError
        else:
            want = _oracle(logits[i, : tree.num_nodes], tree, pos, {stop})
        have = type(got[i]) if isinstance(got[i], GrammarStateError) else got[i]
        assert have == want, (i, kinds[i], pos, tree, have, want)
        if kinds[i] == "lazy" and isinstance(got[i], tuple):
            nodes, bonus = got[i]
            run = [tree.token_list[k] for k in nodes[1:]] + [bonus]
            assert _same_state(matchers[i], pos, run), (i, pos, run)


def test_a_lazy_walk_meets_forbidden_tokens_and_masks_them_on_demand():
    """The model wants a token the grammar forbids at the root: the row is filled, masked on
    the device and its best allowed token accepted (one forbidden row in the stats)."""
    backend, _, doc, stop = _setup()
    vocab = backend.vocab_size
    tree = DraftTree([doc[0], doc[1], doc[2]], [-1, 0, 1])
    logits = torch.zeros(1, 3, vocab)
    logits[0, 0, doc[1]] = 5.0
    logits[0, 0, 7] = 9.0  # forbidden at the start of the document
    logits[0, 1, doc[2]] = 5.0
    logits[0, 2, doc[3]] = 5.0
    m = _matcher_at(1)
    got, stats = verify_greedy_batch(
        logits, [tree], [GreedyRequest(0, stop_token_ids={stop}, matcher=m)]
    )
    assert got[0] == _oracle(logits[0], tree, 1, {stop}) == ([0, 1, 2], doc[3])
    assert stats.forbidden_rows == 1
    assert _same_state(m, 1, doc[1:4])


def test_a_terminated_or_failing_matcher_ends_only_its_request():
    backend, compiled, doc, stop = _setup()
    vocab = backend.vocab_size
    trees = [DraftTree([stop], [-1]), DraftTree([doc[0], doc[1]], [-1, 0])]
    logits = torch.zeros(2, 2, vocab)
    logits[1, 0, doc[1]] = 5.0
    logits[1, 1, doc[2]] = 5.0
    done = _matcher_at(len(doc))  # accepted the stop token: terminated

    class Broken:
        info = done.info

        def is_terminated(self):
            raise RuntimeError("native state lost")

    for bad in (done, Broken()):
        m = _matcher_at(1)
        got, _ = verify_greedy_batch(
            logits,
            trees,
            [GreedyRequest(i, stop_token_ids={stop}, matcher=x) for i, x in enumerate([bad, m])],
        )
        assert isinstance(got[0], GrammarStateError)
        assert got[1] == ([0, 1], doc[2])


def test_lazy_matchers_must_fit_the_batch():
    backend, _, doc, stop = _setup()
    tree = DraftTree([doc[0]], [-1])
    logits = torch.zeros(1, 1, backend.vocab_size)
    rows = allocate_token_bitmask(1, backend.vocab_size)
    with pytest.raises(BitmaskError, match="both bitmask rows and a lazy matcher"):
        verify_greedy_batch(
            logits, [tree], [GreedyRequest(0, offset=0, matcher=_matcher_at(1))], bitmask=rows
        )
    with pytest.raises(BitmaskError, match="masks"):
        verify_greedy_batch(logits[..., :100], [tree], [GreedyRequest(0, matcher=_matcher_at(1))])
    chain = DraftTree([doc[0], doc[1], doc[2]], [-1, 0, 0])
    logits = torch.zeros(1, 3, backend.vocab_size)
    with pytest.raises(BitmaskError, match="not a path from the root"):
        verify_greedy_batch(
            logits, [chain], [GreedyRequest(0, matcher=_matcher_at(1), pre_accepted=[1, 2])]
        )


def test_the_first_branch_is_accepted_as_far_as_the_grammar_allows():
    backend, _, doc, stop = _setup()
    # root -> doc[1] -> doc[2] -> 7 (forbidden) -> doc[3]; a second branch is never taken
    tree = DraftTree([doc[0], doc[1], 7, doc[2], 7, doc[3]], [-1, 0, 0, 1, 3, 4])
    m = _matcher_at(1)
    assert pre_accept_first_branch(m, tree) == [1, 3]
    assert _same_state(m, 1, [doc[1], doc[2]])
