"""The fused decoder on CUDA (its Triton kernels): logits against Hugging Face's forward of the
same random-weight Llama model in float32 and bfloat16, with and without CUDA graphs, while
requests and tree shapes change."""

import random

import pytest
import torch

from spec_grammar.bench.gpu import build_model
from spec_grammar.tree import DraftTree
from spec_grammar.worker.decoder import ops
from spec_grammar.worker.runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tree(rng: random.Random, root: int, n: int) -> DraftTree:
    return DraftTree([root] + [rng.randrange(1000) for _ in range(n - 1)], [-1] + [rng.randrange(i) for i in range(1, n)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graphs", [False, True])
def test_fused_cuda_logits_match_hf(dtype, graphs):
    torch.manual_seed(0)
    model = build_model("smollm2-135m", "cuda", dtype, num_hidden_layers=4)
    hf = ModelRunner(model, cuda_graphs=False, fused_forward=False)
    fused = ModelRunner(model, cuda_graphs=graphs)
    assert fused.uses_fused_forward and ops.use_triton(next(model.parameters()))
    rng = random.Random(1)
    roots = {}
    for step in range(10):
        if step % 3 == 0:
            rid, prompt = f"r{step}", [rng.randrange(1000) for _ in range(rng.choice([5, 40, 200]))]
            for r in (hf, fused):
                r.add(rid, prompt)
            roots[rid] = prompt[-1]
        rids = sorted(roots)
        trees = [_tree(rng, roots[rid], rng.choice([1, 4, 9, 16])) for rid in rids]
        a, b = hf.forward_trees(rids, trees), fused.forward_trees(rids, trees)
        for i, t in enumerate(trees):
            x, y = a[i, : t.num_nodes], b[i, : t.num_nodes]
            if dtype == torch.float32:
                assert torch.allclose(x, y, rtol=1e-3, atol=1e-3 * x.abs().max().item()), step
            else:  # bf16 rounds differently inside fused kernels: same distribution, near-equal argmax
                cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
                assert cos.min() > 0.995, (step, cos.min().item())
        for rid, t in zip(rids, trees):
            for r in (hf, fused):
                r.commit(rid, [0, 1] if t.num_nodes > 1 and t.parent_list[1] == 0 else [0])
            roots[rid] = t.token_list[1] if t.num_nodes > 1 else t.token_list[0]
