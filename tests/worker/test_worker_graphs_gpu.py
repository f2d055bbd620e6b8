"""CUDA graphs of the verify forward (``ModelRunner(cuda_graphs=True)``) against eager forwards
of the same runner code: logits equal step by step while requests come and go, the tree shape
changes and the KV buffers grow (which re-captures every graph), and the speculative worker's
outputs are token-identical with and without graphs, overlap on and off.

float64 random-weight Llama models (no download; the device may hold no model files): graph and
eager pad batches differently, so cuBLAS may pick other kernels, and float64 keeps those
differences far below any argmax gap (the rest of the gap: RMSNorm computes in float32 whatever
the model dtype, so graph and eager logits agree to a few float32 ulps, not to float64)."""

import os
import random

import pytest
import torch
from runner_churn import random_tree

from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.specs import JsonSchema
from spec_grammar.testing.model_shapes import build_model
from spec_grammar.worker.engine import SpecWorker
from spec_grammar.worker.request import Request
from spec_grammar.worker.runner import ModelRunner
from spec_grammar.worker.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("arch,evict", [("llama", False), ("gemma3", False), ("llama", True)])
def test_graph_logits_equal_eager_while_batch_and_buffers_change(arch, evict):
    """``evict``: an output budget of one byte keeps one graph at a time (each new bucket drops
    the last one, which is captured again when it comes back)."""
    torch.manual_seed(0)
    if arch == "llama":
        model = build_model("smollm2-135m", "cuda", torch.float64, num_hidden_layers=2)
    else:  # per-layer-type masks with a sliding window inside the graph
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma3ForCausalLM(config).to("cuda", torch.float64).eval()
    graph, eager = ModelRunner(model, cuda_graphs=True), ModelRunner(model, cuda_graphs=False)
    if evict:
        graph._graphs.max_output_bytes = 1
    rng = random.Random(0)
    roots: dict[str, int] = {}
    for step in range(40):
        if (
            step % 7 == 0 or not roots
        ):  # a new request, sometimes with a prompt that grows the buffers
            rid = f"r{step}"
            prompt = [rng.randrange(1000) for _ in range(rng.choice([3, 20, 300]))]
            for r in (graph, eager):
                r.add(rid, prompt)
            roots[rid] = prompt[-1]
        if step % 11 == 10 and len(roots) > 1:
            gone = rng.choice(sorted(roots))
            for r in (graph, eager):
                r.remove(gone)
            del roots[gone]
        rids = sorted(roots)
        trees = [random_tree(rng, roots[r], rng.randint(1, 20), 1000) for r in rids]
        a, top = graph.forward_trees(rids, trees, with_argmax=True)
        a, top = a.clone(), top.clone()
        b = eager.forward_trees(rids, trees)
        for i, t in enumerate(trees):
            torch.testing.assert_close(a[i, : t.num_nodes], b[i, : t.num_nodes], atol=1e-5, rtol=0)
            # the graph's own argmax belongs to this replay's logits, in the caller's order
            assert torch.equal(top[i, : t.num_nodes], a[i, : t.num_nodes].argmax(-1))
        for rid, t in zip(rids, trees):
            node = rng.randrange(t.num_nodes)
            path = t.path_nodes(node)
            for r in (graph, eager):
                r.commit(rid, path)
            roots[rid] = rng.randrange(1000)  # the bonus token: the next tree's root
            assert graph.cache_len(rid) == eager.cache_len(rid)
    assert graph.graph_captures > 0 and eager.graph_captures == 0
    if evict:
        assert len(graph._graphs) == 1


def test_worker_outputs_identical_with_and_without_graphs():
    from spec_grammar.models import load_tokenizer
    from spec_grammar.registry import get_backend

    torch.manual_seed(0)
    model = build_model("smollm2-135m", "cuda", torch.float64, num_hidden_layers=3)
    tok = load_tokenizer(os.environ.get("SPEC_GRAMMAR_TOKENIZER", "smollm2"))
    backend = get_backend("xgrammar", tok, vocab_size=model.config.vocab_size)
    schemas = [r["schema"] for r in jsonschemabench_sample()[:5]]

    def run(graphs: bool, overlap: bool, lazy: bool | None = None):
        reqs = [
            Request(f"JSON {i}:", JsonSchema(s), SamplingParams(max_new_tokens=32), rid=f"r{i}")
            for i, s in enumerate(schemas)
        ]
        reqs.append(
            Request("Text:", None, SamplingParams(max_new_tokens=20, ignore_eos=True), rid="plain")
        )
        runner = ModelRunner(model, cuda_graphs=graphs)
        with SpecWorker(
            runner,
            tok,
            backend=backend,
            draft="ngram",
            num_draft_tokens=8,
            overlap=overlap,
            lazy_grammar=lazy,
        ) as w:
            out = w.run(reqs)
            assert any(s.lazy_requests for s in w.step_stats) == bool(lazy)
        return [(r.token_ids, r.finish_detail) for r in out], runner.graph_captures

    want, _ = run(False, False, lazy=False)
    for overlap, lazy in ((True, False), (False, False), (True, True)):
        got, captures = run(
            True, overlap, lazy
        )  # lazy: no tree fills, matchers asked token by token
        assert got == want
        assert captures > 0
    assert all(reason in ("grammar", "length") for _, reason in want)
    # every step's grammar rows masked early (while the forward runs) instead of on demand
    import spec_grammar.worker.engine as engine
    from spec_grammar.worker.placement import EarlyMask

    launches = []
    real = engine.launch_masked_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EarlyMask, "worth_it", lambda self, since_ms: True)
        mp.setattr(engine, "launch_masked_rows", lambda *a: launches.append(1) or real(*a))
        got, _ = run(True, True, lazy=False)
    assert got == want and launches
