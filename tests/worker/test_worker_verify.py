"""Per-node logits processing (against Hugging Face's own logits processors) and tree verification:
greedy on hand-built trees, and a statistical test that tree speculative sampling is lossless."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spec_grammar.bitmask import pack_bool_mask
from spec_grammar.errors import BitmaskError, GrammarStateError, InvalidTokenError
from spec_grammar.tree import DraftTree
from spec_grammar.worker.sampling import SamplingParams, make_generator, process_tree_logits
from spec_grammar.worker.verify import token_logprobs, verify, verify_greedy, verify_stochastic

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NEG = float("-inf")


def hf_row(logits_row, prefix, prompt_len, params, allowed):
    """One row processed the plain way: Hugging Face processors for the repetition penalty,
    temperature, top-k and top-p; OpenAI's formula for frequency/presence; then the mask."""
    ids = torch.tensor([prefix])
    x = logits_row[None].clone()
    x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    out_counts = torch.bincount(
        torch.tensor(prefix[prompt_len:], dtype=torch.long), minlength=x.shape[1]
    )
    x = (
        x
        - params.frequency_penalty * out_counts
        - params.presence_penalty * (out_counts > 0).float()
    )
    for tok, b in params.logit_bias.items():
        x[0, tok] += b
    x = x.masked_fill(~allowed[None], NEG)
    x = TemperatureLogitsWarper(params.temperature)(ids, x)
    x = TopKLogitsWarper(params.top_k)(ids, x)
    x = TopPLogitsWarper(params.top_p)(ids, x)
    return x[0]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_equal_plain_processing_of_their_own_prefix(device):
    g = torch.Generator().manual_seed(0)
    vocab = 40
    tree = DraftTree.from_parents([7, 3, 9, 3, 7, 3, -1, 12], [-1, 0, 0, 1, 3, 2, 0, 4])
    n = tree.num_nodes
    logits = torch.randn(n, vocab, generator=g) * 3
    context = [5, 7, 3, 3, 11, 7]  # prompt [5, 7, 3], output [3, 11, 7]; root token 7
    allowed = torch.rand(n, vocab, generator=g) < 0.7
    allowed[:, [3, 7, 9, 12]] = True
    allowed[6] = False  # an invalid node's row: all zero
    params = SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.25,
        logit_bias={3: 1.5, 20: -2.0},
    )
    bitmask = pack_bool_mask(allowed)
    out = process_tree_logits(logits.to(device), tree, context, params, bitmask, prompt_len=3).cpu()
    assert not out.isnan().any()
    assert torch.isneginf(out[6]).all()
    for node in range(n):
        if node == 6:
            continue
        prefix = context + tree.path(node)
        expected = hf_row(logits[node], prefix, 3, params, allowed[node])
        torch.testing.assert_close(out[node], expected, atol=1e-5, rtol=1e-5)
        # the plain (root-only) call on the same prefix gives the same row: spec == no-spec
        root_only = DraftTree.chain(prefix[-1], [])
        row, row_mask = logits[node : node + 1].to(device), bitmask[node : node + 1]
        plain = process_tree_logits(row, root_only, prefix, params, row_mask, prompt_len=3).cpu()
        torch.testing.assert_close(plain[0], out[node], atol=0, rtol=0)


def test_greedy_processing_is_masked_penalized_logits():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, top_k=1, top_p=0.1)
    mask = pack_bool_mask(torch.tensor([[True, True, True, False]]))
    out = process_tree_logits(logits, DraftTree.chain(1, []), [1], params, mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 3.0, NEG]]))


def test_processing_errors():
    tree = DraftTree.chain(1, [2])
    with pytest.raises(BitmaskError, match="2-node tree"):
        process_tree_logits(torch.zeros(3, 8), tree, [1], SamplingParams())
    with pytest.raises(InvalidTokenError, match="logit_bias"):
        process_tree_logits(torch.zeros(2, 8), tree, [1], SamplingParams(logit_bias={8: 1.0}))
    with pytest.raises(InvalidTokenError, match="context"):
        process_tree_logits(torch.zeros(2, 8), tree, [9], SamplingParams(repetition_penalty=1.1))
    with pytest.raises(BitmaskError, match="rows"):
        one_row = torch.zeros(1, 1, dtype=torch.int32)
        process_tree_logits(torch.zeros(2, 8), tree, [1], SamplingParams(), one_row)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


# -- greedy -----------------------------------------------------------------------------------
# root(0) -> n1(2), n2(3), n3(2, duplicate of n1), n6(-1); n1 -> n4(5); n4 -> n5(1)
TREE = DraftTree.from_parents([0, 2, 3, 2, 5, 1, -1], [-1, 0, 0, 0, 1, 4, 0])


def rows(*argmaxes, vocab=6):
    """One row per node with a unique maximum at the given token (None: all -inf)."""
    out = torch.zeros(len(argmaxes), vocab)
    for i, t in enumerate(argmaxes):
        if t is None:
            out[i] = NEG
        else:
            out[i, t] = 1.0
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_verify_greedy_hand_built(device):
    r = rows(2, 5, 0, 0, 4, 0, 0).to(device)
    assert verify_greedy(r, TREE) == ([0, 1, 4], 4)
    # n4's argmax is n5's token: the whole chain is accepted, bonus from n5's row
    r2 = rows(2, 5, 0, 0, 1, 3, 0).to(device)
    assert verify_greedy(r2, TREE) == ([0, 1, 4, 5], 3)
    # ties resolve to the lowest id: tokens 3 and 2 tie at the root -> 2 (n1)
    tie = r.clone()
    tie[0, 3] = 1.0
    assert verify_greedy(tie, TREE) == ([0, 1, 4], 4)
    # an invalid node is never accepted; its valid duplicate sibling n3 is
    valid = torch.tensor([True, False, True, True, False, False, False])
    assert verify_greedy(r, TREE, valid) == ([0, 3], 0)
    # a stop token is never expanded: it becomes the bonus
    assert verify_greedy(r, TREE, stop_token_ids={5}) == ([0, 1], 5)
    # a child whose row allows nothing (grammar terminated after it) likewise
    dead = rows(2, 5, 0, 0, None, 0, 0).to(device)
    assert verify_greedy(dead, TREE) == ([0, 1], 5)
    # no child matches: bonus only
    assert verify_greedy(rows(4, 0, 0, 0, 0, 0, 0).to(device), TREE) == ([0], 4)
    with pytest.raises(GrammarStateError, match="node 0"):
        verify_greedy(rows(None, 0, 0, 0, 0, 0, 0).to(device), TREE)
    with pytest.raises(BitmaskError):
        verify_greedy(r[:3], TREE)


def test_verify_greedy_matches_stepwise_plain_greedy():
    """Random trees with many ties: the committed tokens equal plain greedy decoding (root-only
    verification, one row at a time) along the tree."""
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(-1, 5, (n,), generator=g).tolist()
        tree = DraftTree.from_parents(tokens, parents)
        processed = torch.randint(0, 3, (n, 5), generator=g).float()
        processed[torch.rand(n, 5, generator=g) < 0.3] = NEG
        processed[:, 4] = 0.0  # every row allows something
        valid = torch.rand(n, generator=g) < 0.8
        valid[0] = True
        accepted, bonus = verify_greedy(processed, tree, valid)
        committed = [tree.token_list[a] for a in accepted[1:]] + [bonus]
        node, expected = 0, []
        while True:
            _, tok = verify_greedy(
                processed[node : node + 1], DraftTree.chain(tree.token_list[node], [])
            )
            expected.append(tok)
            ok = [c for c in tree.children(node) if valid[c] and tree.token_list[c] == tok]
            if not ok:
                break
            node = ok[0]
        assert committed == expected


# -- stochastic -------------------------------------------------------------------------------
def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    m = observed.sum()
    keep = expected_probs > 0
    assert observed[~keep].sum() == 0, "an outcome of probability 0 was sampled"
    e = expected_probs[keep] * m
    stat = ((observed[keep] - e) ** 2 / e).sum()
    df = int(keep.sum()) - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(stat))


@pytest.mark.parametrize("device", DEVICES)
def test_verify_stochastic_is_lossless(device):
    """Outcome of the first two committed tokens under tree speculative sampling == under plain
    sampling of each processed row. The tree has duplicate siblings, an invalid node, an
    out-of-range token, a stop-token child (its subtree never reached), a child whose row is
    all masked, and grandchildren. When a step commits one token, the second comes from a
    plain root-only step on a "next forward" row."""
    vocab, stop = 6, 4
    g = torch.Generator().manual_seed(2)
    #            0  1  2  3  4  5   6  7  8
    tokens = [0, 2, 2, 4, 1, -1, 3, 5, 0]
    parents = [-1, 0, 0, 0, 0, 0, 1, 1, 3]
    tree = DraftTree.from_parents(tokens, parents)
    n = tree.num_nodes
    allowed = torch.ones(n, vocab, dtype=torch.bool)
    allowed[0, [1, 5]] = False  # so node 4 (token 1) is invalid
    allowed[1, 0] = False
    allowed[7] = False  # grammar terminated after node 7
    valid = torch.tensor([True, True, True, True, False, False, True, True, True])
    params = SamplingParams(temperature=0.9, top_k=4)
    logits = torch.randn(n, vocab, generator=g)
    processed = process_tree_logits(logits.to(device), tree, [0], params, pack_bool_mask(allowed))
    # rows of the next plain step after a one-token commit, one per token
    nxt_logits = torch.randn(vocab, vocab, generator=g)
    nxt = [
        process_tree_logits(
            nxt_logits[t : t + 1].to(device), DraftTree.chain(t, []), [0, t], params
        )
        for t in range(vocab)
    ]

    probs = torch.softmax(processed.cpu().double(), -1)
    cond = torch.zeros(vocab, vocab + 1, dtype=torch.float64)  # column `vocab` = ended (stop)
    for t in range(vocab):
        child = next((c for c in tree.children(0) if valid[c] and tokens[c] == t), None)
        if t == stop:
            cond[t, vocab] = 1.0
        elif child is not None:
            cond[t, :vocab] = probs[child]
        else:
            cond[t, :vocab] = torch.softmax(nxt[t][0].cpu().double(), -1)
    joint = probs[0][:, None] * cond

    gen = make_generator(SamplingParams(seed=3), device)
    m = 20000
    counts = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
    for _ in range(m):
        accepted, bonus = verify_stochastic(
            processed, tree, gen, valid.to(device), stop_token_ids={stop}
        )
        # never accepted: the stop node 3, invalid 4, out-of-range 5, dead-row 7, below-stop 8
        assert not {3, 4, 5, 7, 8}.intersection(accepted)
        committed = [tokens[a] for a in accepted[1:]] + [bonus]
        t1 = committed[0]
        if len(committed) > 1:
            t2 = committed[1]
        elif t1 == stop:
            t2 = vocab
        else:
            t2 = verify_stochastic(nxt[t1], DraftTree.chain(t1, []), gen)[1]
        counts[t1, t2] += 1
    assert chi2_pvalue(counts.sum(1), probs[0]) > 1e-3
    assert chi2_pvalue(counts.flatten(), joint.flatten()) > 1e-3
    tv = 0.5 * (counts / m - joint).abs().sum()
    assert tv < 0.025


def test_stochastic_never_samples_masked_tokens():
    g = torch.Generator().manual_seed(4)
    vocab = 64
    tree = DraftTree.from_parents([0, 1, 2, 3], [-1, 0, 1, 0])
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[0, [1, 3, 60]] = True
    allowed[1, [2, 61]] = True
    allowed[2, [62]] = True
    allowed[3, [63, 5]] = True
    params = SamplingParams(temperature=1.5, top_p=0.95)
    logits = torch.randn(4, vocab, generator=g)
    processed = process_tree_logits(logits, tree, [0], params, pack_bool_mask(allowed))
    gen = make_generator(SamplingParams(seed=0))
    for _ in range(500):
        accepted, bonus = verify_stochastic(processed, tree, gen)
        committed = [tree.token_list[a] for a in accepted[1:]] + [bonus]
        for row, tok in zip(accepted, committed):  # token i is sampled from row accepted[i]
            assert allowed[row, tok]


def test_token_logprobs_and_dispatch():
    g = torch.Generator().manual_seed(5)
    tree = DraftTree.from_parents([0, 2, 3], [-1, 0, 1])
    processed = process_tree_logits(torch.randn(3, 8, generator=g), tree, [0], SamplingParams())
    processed[0, 2] = processed[1, 3] = 50.0
    accepted, bonus = verify(processed, tree, SamplingParams())
    assert accepted == [0, 1, 2]
    lp = token_logprobs(processed, tree, accepted, bonus)
    expected = torch.log_softmax(processed.double(), -1)[[0, 1, 2], [2, 3, bonus]]
    torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), expected)
    with pytest.raises(ValueError, match="Generator"):
        verify(processed, tree, SamplingParams(temperature=1.0))
    a, b = verify(
        processed, tree, SamplingParams(temperature=1.0), make_generator(SamplingParams(seed=1))
    )
    assert a[0] == 0 and 0 <= b < 8
