"""The batched tree fills (``fill_tree_bitmasks`` of xgrammar and llguidance: one pass over many
requests, the library's walks spread over threads, validity and dead rows settled for the batch
at once) against the reference: each job's rows by the generic depth-first walk
(:func:`spec_grammar.traverse.fill_tree_bitmask_dfs`: accept / fill / rollback on the matcher's
own hooks, the conformance suite's oracle path) and each job's own ``fill_tree_bitmask``.

The trees mix what the batch must settle: legal chains (full rows), random siblings (rejected
nodes whose subtrees xgrammar leaves stale), stop tokens (rows past termination), ids outside
the tokenizer (jobs the batch hands to the one-by-one path), forks sharing a library matcher, a
model head wider than the tokenizer (rows through the scratch) and rows that do not follow each
other in job order."""

import json
import random

import pytest
import torch

from spec_grammar.bitmask import unpack_bitmask
from spec_grammar.datasets import bfcl_cases
from spec_grammar.specs import ToolCalls
from spec_grammar.traverse import fill_tree_bitmask_dfs
from spec_grammar.tree import DraftTree


def _backend(name: str, tok, threads: int, vocab: int | None):
    if name == "xgrammar":
        cls = pytest.importorskip("spec_grammar_xgrammar").XGrammarBackend
    else:
        cls = pytest.importorskip("spec_grammar_llguidance").LLGuidanceBackend
    return cls(tok, num_threads=threads, vocab_size=vocab)


pytestmark = pytest.mark.model


def _jobs(backend, tok, rng: random.Random):
    """(matcher, tree) pairs along BFCL examples: true next tokens as a chain, random and
    stop-token siblings, a chain under a rejected node, one tree with an id past the
    tokenizer, one fork per request."""
    eos = tok.eos_token_id
    out = []
    for case in bfcl_cases()[:6]:
        compiled = backend.compile(ToolCalls(case["tools"], whitespace="spaced"))
        ids = tok.encode(
            json.dumps(case["example_output"], separators=(", ", ": ")), add_special_tokens=False
        ) + [eos]
        for p in (1, len(ids) // 2, len(ids) - 3):
            m = backend.matcher(compiled)
            assert m.accept_tokens(ids[:p]) == p
            nxt = ids[p : p + 6]
            extra = [rng.randrange(len(tok)) for _ in range(5)] + [eos, ids[p]]
            tokens = [ids[p - 1]] + nxt + extra
            parents = [-1] + list(range(len(nxt))) + [rng.randrange(len(nxt)) for _ in extra]
            # a rejected node with a chain under it: rows below it stay stale in xgrammar's walk
            bad = next(t for t in range(len(tok)) if t not in ids and t != eos)
            tokens += [bad, *nxt[:3]]
            parents += [0, len(parents), len(parents) + 1, len(parents) + 2]
            out.append((m, DraftTree(tokens, parents)))
            out.append((m.fork(), DraftTree(tokens[:4], parents[:4])))
    m, tree = out[0]
    out.append(
        (m.fork(), DraftTree(tree.token_list + [backend.vocab_size - 1], tree.parent_list + [0]))
    )
    return out


@pytest.mark.parametrize("wide", [False, True], ids=["tokenizer-head", "wider-head"])
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("library", ["xgrammar", "llguidance"])
def test_batch_fill_equals_reference(tok, library, wide, threads):
    vocab = len(tok) + 300 if wide else None
    backend = _backend(library, tok, threads, vocab)
    pairs = _jobs(backend, tok, random.Random(threads))
    # rows in reverse job order with a gap: not one contiguous block
    sizes = [t.num_nodes for _, t in pairs]
    total = sum(sizes) + 5
    offsets, end = [], total
    for n in sizes:
        end -= n
        offsets.append(end)
    jobs = [(m, t, off) for (m, t), off in zip(pairs, offsets)]
    before = [m.num_accepted for m, _, _ in jobs]
    ref = torch.full((total, backend.tokenizer_info.bitmask_width), 0x5A5A5A5A, dtype=torch.int32)
    want = []
    for m, t, off in jobs:
        want.append(fill_tree_bitmask_dfs(m, t, ref, off).tolist())
    for zero_dead in (True, False):
        got_rows = torch.full_like(ref, 0x5A5A5A5A)
        one_rows = torch.full_like(ref, 0x5A5A5A5A)
        got = backend.fill_tree_bitmasks(jobs, got_rows, zero_dead_rows=zero_dead)
        one = [
            m.fill_tree_bitmask(t, one_rows, off, zero_dead_rows=zero_dead) for m, t, off in jobs
        ]
        assert [v.tolist() for v in got] == want == [v.tolist() for v in one]
        if zero_dead:
            # the generic walk leaves the padding ids to fill_tree_bitmask: the tokenizer's agree
            n_tok = len(tok)
            assert torch.equal(unpack_bitmask(got_rows, n_tok), unpack_bitmask(ref, n_tok))
            assert torch.equal(got_rows, one_rows)
        else:  # dead rows are unspecified: the live ones must agree
            for (m, t, off), v in zip(jobs, want):
                stops = set(m.info.stop_token_ids)
                live = [
                    off + k
                    for k in range(t.num_nodes)
                    if v[k] and not (k and t.token_list[k] in stops)
                ]
                assert torch.equal(got_rows[live], one_rows[live])
    assert [m.num_accepted for m, _, _ in jobs] == before
    assert any(not all(v) for v in want) and any(all(v) for v in want)  # both kinds were filled


def _big_job(backend, tok, rng: random.Random):
    """One request whose tree (a 40-token chain of its true next tokens, random and stop-token
    siblings, a rejected node with a chain under it) outweighs the small ones of :func:`_jobs`."""
    eos = tok.eos_token_id
    case = bfcl_cases()[0]
    compiled = backend.compile(ToolCalls(case["tools"], whitespace="spaced"))
    ids = tok.encode(
        json.dumps(case["example_output"], separators=(", ", ": ")), add_special_tokens=False
    ) + [eos]
    m = backend.matcher(compiled)
    assert m.accept_tokens(ids[:1]) == 1
    nxt = ids[1:41]
    tokens, parents = [ids[0]] + nxt, [-1] + list(range(len(nxt)))
    for _ in range(12):  # siblings anywhere along the chain: random ids, EOS, true tokens
        at = rng.randrange(len(nxt))
        tokens.append(rng.choice([rng.randrange(len(tok)), eos, ids[1 + at]]))
        parents.append(at)
    bad = next(t for t in range(len(tok)) if t not in ids and t != eos)
    tokens += [bad, *nxt[:3]]
    parents += [5, len(parents), len(parents) + 1, len(parents) + 2]
    return m, DraftTree(tokens, parents)


@pytest.mark.parametrize("wide", [False, True], ids=["tokenizer-head", "wider-head"])
def test_heavy_tree_cut_into_pieces_equals_reference(tok, wide):
    """A tree that outweighs a thread's share is cut into pieces once its cost is known (each
    walked by a fork of the request's matcher moved along the path to the piece): rows and
    validity stay the reference's in every round, and the request's matcher is not moved."""
    backend = _backend("xgrammar", tok, 4, len(tok) + 300 if wide else None)
    rng = random.Random(7)
    pairs = [_big_job(backend, tok, rng)] + _jobs(backend, tok, rng)[:8]
    jobs, off = [], 0
    for m, t in pairs:
        jobs.append((m, t, off))
        off += t.num_nodes
    before = [m.num_accepted for m, _, _ in jobs]
    ref = torch.zeros((off, backend.tokenizer_info.bitmask_width), dtype=torch.int32)
    want = [fill_tree_bitmask_dfs(m, t, ref, o).tolist() for m, t, o in jobs]
    cut = []
    for zero_dead in (True, True, False):
        if cut:  # measured costs vary with the host's load: make the big tree's certain
            backend._row_cost[jobs[0][0]._shared] = 1.0
        items, _ = backend._work_items([t for _, t, _ in jobs], [m._shared for m, _, _ in jobs])
        cut.append(sum(p is not None for j, p in items if j == 0))
        got_rows = torch.full_like(ref, 0x5A5A5A5A)
        got = backend.fill_tree_bitmasks(jobs, got_rows, zero_dead_rows=zero_dead)
        assert [v.tolist() for v in got] == want
        n_tok = len(tok)
        if zero_dead:
            assert torch.equal(unpack_bitmask(got_rows, n_tok), unpack_bitmask(ref, n_tok))
        else:  # dead rows are unspecified: the live ones must agree
            live = [
                o + k
                for (m, t, o), v in zip(jobs, want)
                for k in range(t.num_nodes)
                if v[k] and not (k and t.token_list[k] in set(m.info.stop_token_ids))
            ]
            assert torch.equal(
                unpack_bitmask(got_rows[live], n_tok), unpack_bitmask(ref[live], n_tok)
            )
    assert cut[0] == 0 and cut[1] >= 2 and cut[2] >= 2  # whole before any cost was measured
    for m, _, _ in jobs:  # microseconds of work in all: one thread, nothing cut
        backend._row_cost[m._shared] = 1e-7
    items, threads = backend._work_items([t for _, t, _ in jobs], [m._shared for m, _, _ in jobs])
    assert threads == 1 and all(p is None for _, p in items)
    assert [m.num_accepted for m, _, _ in jobs] == before
