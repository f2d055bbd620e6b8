"""xgrammar adapter: lazy mask-cache compilation (the default, ``dynamic_compilation=True``)
gives exactly the masks of eager compilation, along real BFCL tool-call outputs (every row of
the accepted path) and on random draft trees over them (``fill_tree_bitmask`` rows and
validity), so a fault in xgrammar's lazy path would show here."""

import json
import random

import pytest
import torch

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.datasets import bfcl_cases
from spec_grammar.specs import ToolCalls
from spec_grammar.tree import DraftTree

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def backends():
    from spec_grammar.models import load_tokenizer
    from spec_grammar.registry import get_backend

    tok = load_tokenizer("smollm2")
    return tok, get_backend("xgrammar", tok), get_backend("xgrammar", tok, dynamic_compilation=False)


def test_lazy_compilation_masks_equal_eager(backends):
    tok, lazy, eager = backends
    rng = random.Random(0)
    for case in bfcl_cases()[:6]:
        spec = ToolCalls(case["tools"], whitespace="spaced")
        ids = tok.encode(json.dumps(case["example_output"], separators=(", ", ": ")), add_special_tokens=False)
        a, b = lazy.matcher(lazy.compile(spec)), eager.matcher(eager.compile(spec))
        rows_a, rows_b = allocate_token_bitmask(1, lazy.vocab_size), allocate_token_bitmask(1, eager.vocab_size)
        for t in ids:
            a.fill_next_token_bitmask(rows_a, 0)
            b.fill_next_token_bitmask(rows_b, 0)
            assert torch.equal(rows_a, rows_b)
            if a.accept_tokens([t]) != 1:  # the example left the grammar: stop this walk
                break
            assert b.accept_tokens([t]) == 1
            if rng.random() < 0.3:  # a tree of the true next tokens and random siblings
                pos = a.num_accepted
                nxt = ids[pos : pos + 4]
                tree = DraftTree([t] + nxt + [rng.randrange(lazy.vocab_size) for _ in range(3)],
                                 [-1] + list(range(len(nxt))) + [rng.randrange(len(nxt) + 1) for _ in range(3)])
                ta, tb = allocate_token_bitmask(tree.num_nodes, lazy.vocab_size), allocate_token_bitmask(tree.num_nodes, eager.vocab_size)
                va, vb = a.fill_tree_bitmask(tree, ta, 0), b.fill_tree_bitmask(tree, tb, 0)
                assert torch.equal(va, vb) and torch.equal(ta, tb)
