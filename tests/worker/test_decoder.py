"""The fused decoder forward (``ModelRunner(fused_forward=True)``) against Hugging Face's forward
of the same model: logits step by step (trees, commits, subsets, chunked prefill), the worker's
outputs on the real SmolLM2, weight sharing, refusals; the Triton kernels' logic against the
torch operations in Triton's interpreter (their CUDA runs are in ``test_decoder_gpu.py``)."""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from real_model import backend, model_and_tokenizer, replays
from runner_churn import compare_under_churn
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.specs import JsonSchema
from spec_grammar.worker.decoder import FusedLlama, cpu_attention, unsupported_reason
from spec_grammar.worker.drafters.model import truncated_model
from spec_grammar.worker.engine import SpecWorker
from spec_grammar.worker.request import Request
from spec_grammar.worker.runner import ModelRunner, RunnerError
from spec_grammar.worker.sampling import SamplingParams

SMALL = dict(
    vocab_size=500,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def _small(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":  # biased q/k/v projections
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    elif kind == "llama3-rope":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE))
    else:  # multi-head attention (no grouping), head_dim set apart from hidden / heads
        model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": 8, "head_dim": 16}))
    return model.to(torch.float64).eval()


# qwen2 (seconds: its own HF model) in the integration lane, the other two in the unit lane
@pytest.mark.parametrize(
    "kind", [pytest.param("qwen2", marks=pytest.mark.integration), "llama3-rope", "mha"]
)
def test_fused_logits_equal_hf_while_requests_and_trees_change(kind):
    """float64: the fused forward runs the HF modules' operations in the same dtypes, so logits
    agree to float64 rounding; forwards over all requests, over a subset in another order, and
    chunked prefills (``prefill_chunk=7``) all go through it."""
    model = _small(kind)
    hf = ModelRunner(model, fused_forward=False, prefill_chunk=7)
    fused = ModelRunner(model, fused_forward=True, prefill_chunk=7)
    assert fused.uses_fused_forward and not hf.uses_fused_forward

    def check(x, y, step):
        assert torch.allclose(x, y, rtol=0, atol=1e-10), (kind, step)

    compare_under_churn(
        hf,
        fused,
        random.Random(0),
        steps=12,
        new_every=4,
        prompt_lens=[2, 9, 30],
        tree_sizes=[1, 3, 6],
        vocab=500,
        check=check,
        subsets=True,
    )


@pytest.mark.parametrize("kind", ["qwen2", "llama-d16"])
def test_fused_float32_cpu_forward_matches_hf_on_ragged_trees(kind):
    """float32 on CPU: the projections run through oneDNN or the small-batch kernel (other GEMMs
    than HF's MKL one), attention through SDPA (qwen2: head size 8) or the CPU attention kernel
    (llama-d16: head size 16, 4 query heads per KV head), and ragged batches run on their real
    rows only (padding skipped), so logits agree with HF's to float32 rounding, not exactly,
    through churn with ragged trees and subsets."""
    if kind == "qwen2":
        model = _small("qwen2").to(torch.float32)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "head_dim": 16})).eval()
    hf = ModelRunner(model, fused_forward=False, prefill_chunk=7)
    fused = ModelRunner(model, prefill_chunk=7)
    assert fused.uses_fused_forward

    def check(x, y, step):
        assert torch.allclose(x, y, rtol=0, atol=1e-4), (step, (x - y).abs().max())

    compare_under_churn(
        hf,
        fused,
        random.Random(1),
        steps=10,
        new_every=3,
        prompt_lens=[1, 5, 17],
        tree_sizes=[1, 2, 7],
        vocab=500,
        check=check,
        subsets=True,
    )


def test_forward_shape_counts_attention_on_real_nodes_where_the_kernel_runs():
    """The draft budget's cost model is told the query rows attention really runs on: each
    request's own nodes where the CPU attention kernel runs (float32, trees of at most its
    ``MAX_QUERIES`` nodes), the batch padded to its largest tree where SDPA does (float64)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "head_dim": 16})).eval()
    f32 = ModelRunner(model)
    f64 = ModelRunner(_small("mha"))
    big = cpu_attention.MAX_QUERIES + 1
    assert f64.forward_shape([1, 4, 2]) == (7, 12)
    assert f32.forward_shape([1, 4, 2]) == (7, 7 if cpu_attention.available() else 12)
    assert f32.forward_shape([1, big]) == (big + 1, 2 * big)


@pytest.mark.model
def test_fused_worker_outputs_equal_hf_on_real_smollm2():
    """The speculative worker on the real SmolLM2 (float64) writes the same tokens with the
    fused forward as with HF's, and every output replays on a fresh matcher."""
    model, tok = model_and_tokenizer()
    schemas = jsonschemabench_sample()[:2]
    outs = {}
    for fused in (False, True):
        runner = ModelRunner(model, fused_forward=fused)
        reqs = [
            Request(
                tok.encode(f"Write JSON for: {s['id']}"),
                JsonSchema(schema=s["schema"]),
                SamplingParams(max_new_tokens=24),
                rid=f"q{i}",
            )
            for i, s in enumerate(schemas)
        ]
        with SpecWorker(runner, tok, backend=backend("xgrammar"), draft="ngram") as worker:
            outs[fused] = worker.run(reqs)
    for s, a, b in zip(schemas, outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert replays(
            "xgrammar", JsonSchema(schema=s["schema"]), b.token_ids, b.finish_detail == "grammar"
        )


def test_merged_weights_share_the_model_memory():
    """q/k/v and gate/up become views of one merged tensor (no copy kept); a self-draft over the
    same layers reuses the merged tensors; the HF forward still gives the same logits."""
    model = _small("qwen2")
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).logits
    fused = FusedLlama(model)
    attn = model.model.layers[0].self_attn
    merged = fused.layers[0].qkv_w
    assert attn.q_proj.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    assert (
        attn.v_proj.bias.untyped_storage().data_ptr()
        == fused.layers[0].qkv_b.untyped_storage().data_ptr()
    )
    assert torch.equal(model(ids).logits, before)
    draft = FusedLlama(truncated_model(model, 2))
    assert draft.layers[0].qkv_w is merged and len(draft.layers) == 2


def test_unsupported_models_and_bad_values_are_refused():
    config = Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
    )
    gemma = Gemma3ForCausalLM(config).eval()
    assert "gemma3" in unsupported_reason(gemma)
    with pytest.raises(RunnerError, match="cannot run this model: model type 'gemma3_text'"):
        ModelRunner(gemma, fused_forward=True)
    assert not ModelRunner(gemma).uses_fused_forward  # auto: HF forward
    window = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    window.config.model_type, window.config.sliding_window = "mistral", 16
    with pytest.raises(RunnerError, match="sliding-window"):
        ModelRunner(window, fused_forward=True)
    with pytest.raises(RunnerError, match="fused_forward must be"):
        ModelRunner(_small("mha"), fused_forward="on")
    assert ModelRunner(_small("mha")).uses_fused_forward  # auto: on for a supported model


_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import torch
    from spec_grammar.worker.decoder import ops, triton_ops
    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(6, 48, generator=g) for _ in range(3))
    w = w[0]
    for res in (None, r):
        r1, r2 = (None, None) if res is None else (res.clone(), res.clone())
        a, b = triton_ops.rms_norm(x, w, 1e-5, r1), ops.rms_norm(x, w, 1e-5, r2)
        assert torch.allclose(a, b, atol=1e-5), "norm"
        assert res is None or torch.equal(r1, r2), "residual"
    gu = torch.randn(6, 80, generator=g)
    assert torch.allclose(triton_ops.silu_mul(gu), ops.silu_mul(gu), atol=1e-6), "silu"
    b, n, hq, hk, d = 2, 3, 4, 2, 8
    qkv = torch.randn(b * n, (hq + 2 * hk) * d, generator=g)
    pos = torch.tensor([5, 6, 6, 10, 11, 12])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    bufs = [torch.zeros(4, hk, 32, d) for _ in range(4)]
    rows, wp = torch.tensor([2, 0]), torch.tensor([[5, 6, 7], [10, 11, 12]])
    cos, sin = ops.rotary_cos_sin(pos, inv, 0.9, torch.float32)
    q1 = triton_ops.rope_and_cache(qkv, cos, sin, bufs[0], bufs[1], rows, wp.reshape(-1), b, n, hq, hk, d)
    q2 = ops.rope_and_cache(qkv, cos, sin, bufs[2], bufs[3], rows, wp, b, n, hq, hk, d)
    assert torch.allclose(q1, q2, atol=1e-5), "rope q"
    assert torch.allclose(bufs[0], bufs[2], atol=1e-5) and torch.equal(bufs[1], bufs[3]), "cache"
    assert bufs[0][2, :, 5:8].abs().sum() > 0 and bufs[0][1].abs().sum() == 0, "rows"
    print("interpreted decoder kernels ok")
    """
)


def test_decoder_kernels_logic_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRET_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interpreted decoder kernels ok" in proc.stdout
