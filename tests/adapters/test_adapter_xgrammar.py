"""xgrammar adapter: two settings that change how masks are computed but must not change them,
checked along real BFCL tool-call outputs (every row of the accepted path) and on random draft
trees over them (``fill_tree_bitmask`` rows, at a row offset, and validity):

* lazy mask-cache compilation (the default, ``dynamic_compilation=True``) against eager;
* a model head wider than the tokenizer (xgrammar then fills tokenizer-wide rows that the
  adapter copies into the model-wide bitmask) against a head of the tokenizer's width: same
  bits, padding ids never allowed."""

import json
import random

import pytest
import torch

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.datasets import bfcl_cases
from spec_grammar.errors import GrammarStateError
from spec_grammar.specs import ToolCalls
from spec_grammar.tree import DraftTree

XGrammarBackend = pytest.importorskip("spec_grammar_xgrammar").XGrammarBackend

pytestmark = pytest.mark.model


def _same_masks(tok, a_backend, b_backend) -> None:
    """``b``'s rows equal ``a``'s on ``a``'s width and are zero past it."""
    width = allocate_token_bitmask(1, a_backend.vocab_size).shape[1]
    rng = random.Random(0)
    for case in bfcl_cases()[:6]:
        spec = ToolCalls(case["tools"], whitespace="spaced")
        ids = tok.encode(
            json.dumps(case["example_output"], separators=(", ", ": ")), add_special_tokens=False
        )
        a, b = (
            a_backend.matcher(a_backend.compile(spec)),
            b_backend.matcher(b_backend.compile(spec)),
        )
        rows_a, rows_b = (
            allocate_token_bitmask(2, a_backend.vocab_size),
            allocate_token_bitmask(2, b_backend.vocab_size),
        )
        for t in ids:
            a.fill_next_token_bitmask(rows_a, 1)
            b.fill_next_token_bitmask(rows_b, 1)
            assert torch.equal(rows_a[1], rows_b[1, :width]) and not rows_b[1, width:].any()
            if a.accept_tokens([t]) != 1:  # the example left the grammar: stop this walk
                break
            assert b.accept_tokens([t]) == 1
            if rng.random() < 0.3:  # a tree of the true next tokens and random siblings
                pos = a.num_accepted
                nxt = ids[pos : pos + 4]
                tree = DraftTree(
                    [t] + nxt + [rng.randrange(len(tok)) for _ in range(3)],
                    [-1] + list(range(len(nxt))) + [rng.randrange(len(nxt) + 1) for _ in range(3)],
                )
                ta = allocate_token_bitmask(tree.num_nodes + 3, a_backend.vocab_size)
                tb = allocate_token_bitmask(tree.num_nodes + 3, b_backend.vocab_size)
                va, vb = a.fill_tree_bitmask(tree, ta, 3), b.fill_tree_bitmask(tree, tb, 3)
                assert torch.equal(va, vb)
                assert torch.equal(ta[3:], tb[3:, :width]) and not tb[3:, width:].any()


def test_lazy_compilation_masks_equal_eager(tok):
    from spec_grammar.registry import get_backend

    _same_masks(
        tok, get_backend("xgrammar", tok), get_backend("xgrammar", tok, dynamic_compilation=False)
    )


def test_head_wider_than_tokenizer_same_masks(tok):
    """128,256 logits (Llama-3's head) over SmolLM2's 49,152-token tokenizer."""
    from spec_grammar.registry import get_backend

    exact, wide = get_backend("xgrammar", tok), get_backend("xgrammar", tok, vocab_size=128256)
    assert wide._narrow and not exact._narrow
    _same_masks(tok, exact, wide)


def test_plain_tokenizers_tokenizer_same_masks(tok):
    """A ``tokenizers.Tokenizer`` (what a user without transformers has; ``TokenizerInfo``
    takes it) was refused by xgrammar's ``from_huggingface`` with "Unsupported tokenizer type":
    the default backend did not work with it. Oracle: the transformers tokenizer around it."""
    from spec_grammar.registry import get_backend

    plain = get_backend(
        "xgrammar",
        tok.backend_tokenizer,
        vocab_size=len(tok) + 64,
        stop_token_ids=[tok.eos_token_id],
    )
    _same_masks(tok, get_backend("xgrammar", tok), plain)


def test_special_tokens_as_0xff_same_masks_as_empty_text(tok):
    """Special ids are given the byte 0xFF (no UTF-8 text holds it) rather than empty text,
    which xgrammar rejects one by one in every mask. Oracle: a backend whose xgrammar
    vocabulary gives them empty text (xgrammar's own never-allowed tokens)."""
    import xgrammar as xgr

    from spec_grammar.registry import get_backend

    fast = get_backend("xgrammar", tok)
    info = fast._xgr_info
    specials = fast._special_set
    assert specials, "the tokenizer needs special tokens for this test"
    decoded = [b"" if t in specials else b for t, b in enumerate(info.decoded_vocab)]
    empty = get_backend("xgrammar", tok)
    empty._compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo(
            decoded,
            xgr.VocabType.RAW,
            vocab_size=info.vocab_size,
            stop_token_ids=list(info.stop_token_ids),
            add_prefix_space=info.add_prefix_space,
        ),
        max_threads=1,
        cache_enabled=False,
    )
    _same_masks(tok, empty, fast)


def test_threaded_tree_fill_equals_one_by_one(tok):
    """``num_threads=2``: many requests' tree rows filled on two threads equal each job's own
    ``fill_tree_bitmask`` one after another (itself checked against fresh-matcher replay by the
    conformance suite), forks of one request included, with and without ``zero_dead_rows``;
    a terminated job raises once the others are filled, and every matcher is left as it was."""
    par = XGrammarBackend(tok, num_threads=2)
    assert XGrammarBackend(tok, num_threads=1).num_threads == 1
    rng = random.Random(1)
    jobs, rows = [], 0
    for case in bfcl_cases()[:4]:
        compiled = par.compile(ToolCalls(case["tools"], whitespace="spaced"))
        ids = tok.encode(
            json.dumps(case["example_output"], separators=(", ", ": ")), add_special_tokens=False
        )
        for p in (1, len(ids) // 2):
            m = par.matcher(compiled)
            m.accept_tokens(ids[:p])
            nxt = ids[p : p + 5]
            tree = DraftTree(
                [ids[p - 1]] + nxt + [rng.randrange(len(tok)) for _ in range(4)],
                [-1] + list(range(len(nxt))) + [rng.randrange(len(nxt) + 1) for _ in range(4)],
            )
            for job_matcher in (m, m.fork()):  # a fork shares m's library matcher
                jobs.append((job_matcher, tree, rows))
                rows += tree.num_nodes
    before = [m.num_accepted for m, _, _ in jobs]
    for zero_dead in (True, False):
        one = torch.full((rows, par.tokenizer_info.bitmask_width), 0x5A5A5A5A, dtype=torch.int32)
        two = one.clone()
        want = [m.fill_tree_bitmask(t, one, off, zero_dead_rows=zero_dead) for m, t, off in jobs]
        got = par.fill_tree_bitmasks(jobs, two, zero_dead_rows=zero_dead)
        assert [v.tolist() for v in got] == [v.tolist() for v in want]
        assert torch.equal(one, two)
    assert par._fill_pool is not None  # the pool filled a share
    assert [m.num_accepted for m, _, _ in jobs] == before

    done = par.matcher(compiled)  # the last case's grammar, at the end of its example
    assert done.accept_tokens(ids + [tok.eos_token_id]) == len(ids) + 1 and done.is_terminated()
    bm = allocate_token_bitmask(rows + 1, par.vocab_size)
    with pytest.raises(GrammarStateError):
        par.fill_tree_bitmasks(jobs + [(done, DraftTree([0], [-1]), rows)], bm)
    one = allocate_token_bitmask(rows, par.vocab_size)
    for m, t, off in jobs:
        m.fill_tree_bitmask(t, one, off)
    assert torch.equal(bm[:rows], one)  # the other jobs were still filled
