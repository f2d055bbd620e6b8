"""The fused decoder on CUDA (its Triton kernels): logits against Hugging Face's forward of the
same random-weight Llama model in float32 and bfloat16, with and without CUDA graphs, while
requests and tree shapes change."""

import random

import pytest
import torch
from runner_churn import compare_under_churn

from spec_grammar.testing.model_shapes import build_model
from spec_grammar.worker.decoder import ops
from spec_grammar.worker.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graphs", [False, True])
def test_fused_cuda_logits_match_hf(dtype, graphs):
    torch.manual_seed(0)
    model = build_model("smollm2-135m", "cuda", dtype, num_hidden_layers=4)
    hf = ModelRunner(model, cuda_graphs=False, fused_forward=False)
    fused = ModelRunner(model, cuda_graphs=graphs)
    assert fused.uses_fused_forward and ops.use_triton(next(model.parameters()))

    def check(x, y, step):
        if dtype == torch.float32:
            assert torch.allclose(x, y, rtol=1e-3, atol=1e-3 * x.abs().max().item()), step
        else:  # bf16 rounds differently inside fused kernels: same distribution, near-equal argmax
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            assert cos.min() > 0.995, (step, cos.min().item())

    compare_under_churn(
        hf,
        fused,
        random.Random(1),
        steps=10,
        new_every=3,
        prompt_lens=[5, 40, 200],
        tree_sizes=[1, 4, 9, 16],
        vocab=1000,
        check=check,
    )
