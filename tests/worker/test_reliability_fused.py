"""Reliability regressions for the fused decoder (``spec_grammar.worker.decoder``).

Each test states the intended behaviour against an oracle (the torch reference operations,
which equal Hugging Face's forward)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_grammar.tree import DraftTree
from spec_grammar.worker.runner import ModelRunner, RunnerError

_ROPE_HEAD_DIMS_SCRIPT = textwrap.dedent(
    """
    import torch
    from spec_grammar.worker.decoder import ops, triton_ops
    g = torch.Generator().manual_seed(0)
    failures = []
    for d in (80, 96, 100):  # head_dim // 2 = 40, 48, 50: not powers of two
        b, n, hq, hk = 1, 2, 2, 1
        qkv = torch.randn(b * n, (hq + 2 * hk) * d, generator=g)
        pos = torch.tensor([3, 4])
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = ops.rotary_cos_sin(pos, inv, 1.0, torch.float32)
        bufs = [torch.zeros(2, hk, 8, d) for _ in range(4)]
        rows, wp = torch.tensor([1]), torch.tensor([[3, 4]])
        try:
            q1 = triton_ops.rope_and_cache(qkv, cos, sin, bufs[0], bufs[1], rows, wp.reshape(-1), b, n, hq, hk, d)
        except Exception as e:
            failures.append(f"head_dim={d}: {type(e).__name__}: {e}")
            continue
        q2 = ops.rope_and_cache(qkv, cos, sin, bufs[2], bufs[3], rows, wp, b, n, hq, hk, d)
        if not (torch.allclose(q1, q2, atol=1e-5) and torch.allclose(bufs[0], bufs[2], atol=1e-5)
                and torch.equal(bufs[1], bufs[3])):
            failures.append(f"head_dim={d}: differs from ops.rope_and_cache")
    print("FAILURES:", failures)
    """
)


def test_triton_rope_kernel_handles_head_dims_whose_half_is_not_a_power_of_two():
    """Llama-family models with head_dim 80 / 96 / 100 (e.g. OpenLLaMA-3B: 3200 / 32 = 100) are
    accepted by ``unsupported_reason``, so on CUDA ``ModelRunner(fused_forward=None)`` picks the
    fused decoder for them; its rotary + KV-write kernel must then compute what
    ``ops.rope_and_cache`` computes. Bug: the kernel uses ``tl.arange(0, head_dim // 2)``, which
    Triton only allows for powers of two, so the first forward fails ("arange's range must be a
    power of 2") instead of running (or the runner falling back to the HF forward)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _ROPE_HEAD_DIMS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILURES: []" in proc.stdout, proc.stdout[-3000:]


class _ScaledLinear(torch.nn.Linear):
    """A projection whose output is not ``F.linear(x, weight, bias)`` (as a quantized or
    adapter-carrying linear layer)."""

    def forward(self, x):
        return super().forward(x) * 1.5


class _LoraWrapped(torch.nn.Module):
    """PEFT's LoRA layout (``peft.tuners.lora.Linear``): the base linear in ``base_layer``,
    ``weight`` / ``bias`` read-only properties forwarding to it, a low-rank update added."""

    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False, dtype=base.weight.dtype)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False, dtype=base.weight.dtype)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def _adapted_llama(kind: str):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    for layer in model.model.layers:
        old = layer.self_attn.v_proj
        if kind == "subclass":
            new = _ScaledLinear(old.in_features, old.out_features, bias=False, dtype=torch.float64)
            with torch.no_grad():
                new.weight.copy_(old.weight)
        else:
            new = _LoraWrapped(old)
        layer.self_attn.v_proj = new
    return model


@pytest.mark.parametrize("kind", ["subclass", "lora-wrapper"])
def test_fused_forward_refuses_or_matches_projections_that_are_not_plain_linears(kind):
    """A Llama whose q/k/v (or gate/up) projections are not plain ``nn.Linear`` (a PEFT LoRA
    model with its default ``target_modules=["q_proj", "v_proj"]``, a quantized linear) must
    either be refused by ``fused_forward=True`` with a :class:`RunnerError` (and then run HF's
    forward under ``fused_forward=None``) or give HF's logits. Bugs: ``unsupported_reason``
    only checks the attribute names; the subclass silently loses its forward (logits off by
    ~0.1), the PEFT layout makes the constructor crash with ``KeyError: "attribute 'weight'
    already exists"`` (on CUDA also with the default ``fused_forward=None``)."""
    model = _adapted_llama(kind)
    ids = [1, 2, 3, 4]
    hf = ModelRunner(model, fused_forward=False)
    hf.add("a", ids)
    expected = hf.forward_trees(["a"], [DraftTree([4], [-1])])
    try:
        fused = ModelRunner(model, fused_forward=True)
    except RunnerError:
        return  # refused with a clear error: fine
    fused.add("a", ids)
    got = fused.forward_trees(["a"], [DraftTree([4], [-1])])
    assert torch.allclose(got, expected, atol=1e-9), (got - expected).abs().max().item()


def test_fused_runner_keeps_the_models_parameters_and_their_requires_grad():
    """Building a fused runner must leave the model usable as before: the same ``Parameter``
    objects (an optimizer made earlier still updates the weights the model computes with) and
    the same ``requires_grad``. Bug: ``_merged`` replaces q/k/v/gate/up by new
    ``Parameter(view, requires_grad=False)``: a later training step (e.g. generate rollouts with
    the SpecWorker on CUDA, where the fused decoder is the default, then train) silently leaves
    those weights unchanged."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    before = {n: (p, p.requires_grad) for n, p in model.named_parameters()}
    ModelRunner(model, fused_forward=True)
    after = dict(model.named_parameters())
    replaced = [n for n, (p, _) in before.items() if after[n] is not p]
    frozen = [n for n, (p, rg) in before.items() if after[n].requires_grad != rg]
    assert not replaced and not frozen, (replaced, frozen)


@pytest.mark.parametrize("fused", [True, False])
def test_self_draft_runner_follows_the_workers_fused_forward(fused):
    """``SpecWorker(fused_forward=...)`` / ``generate --no-fused-forward`` choose the decoder;
    the ``self:L`` (and ``model:PATH``) drafter's runner must follow that choice. Bug:
    ``make_drafter`` builds ``ModelRunner(draft_model, device=device)`` without it, so the draft
    always takes the runner default: on CUDA ``--no-fused-forward --draft self:L`` still runs
    (and re-points the target's weights for) the fused decoder, so the flag is no workaround
    for a fused-decoder failure; on CPU ``fused_forward=True`` drafts with HF's forward."""
    from spec_grammar.models import load_tokenizer
    from spec_grammar.worker import SpecWorker

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    worker = SpecWorker(
        model, load_tokenizer("smollm2"), backend=None, draft="self:1", fused_forward=fused
    )
    drafter = getattr(worker.drafter, "inner", worker.drafter)
    assert worker.runner.uses_fused_forward == fused
    assert drafter.runner.uses_fused_forward == fused


def test_merged_weights_are_freed_once_the_runner_is_gone_and_the_model_moves():
    """After the fused runner is dropped and the model is converted (``model.to("cpu")`` after
    serving on a GPU, ``.to(dtype)``), no copy of its old weights may stay alive: that is what
    ``.to`` does for any HF model. Bug: the module-level ``_MERGED`` cache (weak only in the
    q_proj / gate_proj module, strong in the merged tensors) keeps the old merged q/k/v and
    gate/up tensors -- most of a Llama's non-embedding weights, on the old device -- for as long
    as the model lives."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
        .to(torch.float64)
        .eval()
    )
    runner = ModelRunner(model, fused_forward=True)
    old = weakref.ref(runner._fused.layers[0].qkv_w)
    del runner
    model.to(torch.float32)
    gc.collect()
    assert old() is None, "the float64 merged q/k/v weight is still referenced"
