"""ModelRunner on the real SmolLM2: tree-attention logits equal plain sequential forwards, commit
keeps exactly the accepted path, batches mix cache lengths, rows come and go mid-batch."""

from __future__ import annotations

import pytest
import torch
from emulated_graphs import make_runner

from spec_grammar.tree import DraftTree
from spec_grammar.worker.runner import ModelRunner, RunnerError

pytestmark = pytest.mark.model

ATOL = 5e-4  # fp32; a wrong mask or position shifts logits by O(1)


@pytest.fixture(params=["sdpa", "eager"])
def attn_model(request, model):
    before = model.config._attn_implementation
    model.set_attn_implementation(request.param)
    yield model
    model.set_attn_implementation(before)


def reference(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, ``(len, V)`` float32 logits of a plain forward without cache. One batched
    forward, right-padded: under causal attention the padding never touches real positions."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def assert_tree_logits(
    model, cases: list[tuple[torch.Tensor, list[int], DraftTree]], atol=ATOL
) -> None:
    """For each ``(logits (N, V), context, tree)``: row n == the plain forward of
    ``context + path(n)`` at its last position. A reference sequence per leaf covers the whole
    root..leaf path. Nodes with invalid tokens (and their subtrees) are skipped: their rows are
    garbage by contract."""
    seqs, spans = [], []
    for logits, context, tree in cases:
        vocab, n = logits.shape[-1], tree.num_nodes
        bad = {i for i in range(1, n) if not 0 <= tree.token_list[i] < vocab}
        for i in range(1, n):
            if tree.parent_list[i] in bad:
                bad.add(i)
        good = set(range(n)) - bad
        leaves = [i for i in good if not good.intersection(tree.children(i))]
        covered = set()
        for leaf in leaves:
            seqs.append(context + tree.path(leaf))
            spans.append((logits, tree.path_nodes(leaf), len(context) - 1))
            covered.update(tree.path_nodes(leaf))
        assert covered == good
    for ref, (logits, nodes, offset) in zip(reference(model, seqs), spans):
        torch.testing.assert_close(logits[nodes], ref[offset:], atol=atol, rtol=0)


# real text ("The capital of France is", "Hi", "One two three four"); "Hi" is one token: an
# empty cache, the root is the whole context
PROMPT_A = [504, 3575, 282, 4649, 314]
PROMPT_B = [26843]
PROMPT_C = [2705, 827, 1296, 1876]


def check_tree_logits_and_commit(m, atol=ATOL, graphs=None, fused=None):
    runner = make_runner(m, graphs, fused_forward=fused)
    prompts = {"a": PROMPT_A, "b": PROMPT_B, "c": PROMPT_C}
    for rid, p in prompts.items():
        runner.add(rid, p)
    assert [runner.cache_len(r) for r in "abc"] == [4, 0, 3]
    trees = {
        # branching tree with a duplicate-token sibling and an invalid (-1) leaf
        "a": DraftTree.from_parents(
            [314, 253, 260, 1345, 2365, 28, 253, -1], [-1, 0, 0, 1, 1, 3, 2, 0]
        ),
        "b": DraftTree.chain(26843, []),  # root only: padded to N_max = 8
        "c": DraftTree.chain(1876, [2353, 3098, 2064]),
    }
    order = ["b", "c", "a"]
    logits = runner.forward_trees(order, [trees[r] for r in order])
    assert logits.shape == (3, 8, runner.vocab_size) and logits.dtype == torch.float32
    assert_tree_logits(
        m,
        [(logits[i, : trees[r].num_nodes], prompts[r], trees[r]) for i, r in enumerate(order)],
        atol,
    )
    assert [runner.cache_len(r) for r in "abc"] == [4, 0, 3]  # forward does not commit

    accepted = {"a": [0, 1, 3, 5], "b": [0], "c": [0, 1]}
    bonus = {"a": 29, "b": 28, "c": 2064}
    for rid in "abc":
        runner.commit(rid, accepted[rid])
    committed = {r: prompts[r] + trees[r].path(accepted[r][-1]) + [bonus[r]] for r in "abc"}
    assert [runner.cache_len(r) for r in "abc"] == [len(committed[r]) - 1 for r in "abc"]

    nxt = {
        "a": DraftTree.from_parents([29, 314, 260, 1345], [-1, 0, 0, 2]),
        "b": DraftTree.chain(28, [216]),
        "c": DraftTree.from_parents([2064, 2353, 3098], [-1, 0, 0]),
    }
    logits = runner.forward_trees(list("abc"), [nxt[r] for r in "abc"])
    assert_tree_logits(
        m,
        [(logits[i, : nxt[r].num_nodes], committed[r], nxt[r]) for i, r in enumerate("abc")],
        atol,
    )


def check_remove_add_mid_batch_and_subsets(model, atol=ATOL, graphs=None, fused=None):
    runner = make_runner(model, graphs, fused_forward=fused)
    prompts = {"a": PROMPT_A, "b": PROMPT_B, "c": PROMPT_C}
    for rid, p in prompts.items():
        runner.add(rid, p)
    drafts = {"a": [253], "b": [28, 253], "c": [2353, 3098, 2064]}
    trees = {r: DraftTree.chain(prompts[r][-1], drafts[r]) for r in prompts}
    runner.forward_trees(list(prompts), list(trees.values()))
    runner.commit("a", [0, 1])
    runner.commit("b", [0])
    runner.commit("c", [0, 1, 2, 3])
    ctx = {
        "a": PROMPT_A + [253, 1345],
        "b": PROMPT_B + [29],
        "c": PROMPT_C + [2353, 3098, 2064, 2353],
    }

    runner.remove("a")  # the last row (c) moves into a's row
    runner.add("d", [1604, 803, 24, 81])
    ctx["d"] = [1604, 803, 24, 81]
    assert sorted(runner.request_ids) == ["b", "c", "d"]
    # a subset whose rows are not contiguous (c, d sit in rows 0 and 2), in reverse order
    t_d = DraftTree.from_parents([81, 28, 278, 727], [-1, 0, 1, 0])
    t_c = DraftTree.chain(2353, [3098])
    logits = runner.forward_trees(["d", "c"], [t_d, t_c])
    assert_tree_logits(
        model, [(logits[0, :4], ctx["d"], t_d), (logits[1, :2], ctx["c"], t_c)], atol
    )
    runner.commit("d", [0, 1, 2])
    ctx["d"] += [28, 278, 727]
    logits = runner.forward_trees(["b", "d"], [DraftTree.chain(29, []), DraftTree.chain(727, [])])
    ref_b, ref_d = reference(model, [ctx["b"], ctx["d"]])
    torch.testing.assert_close(logits[:, 0], torch.stack([ref_b[-1], ref_d[-1]]), atol=atol, rtol=0)


def check_chunked_prefill_and_extend(model, atol=ATOL, fused=None):
    runner = ModelRunner(model, prefill_chunk=2, fused_forward=fused)
    runner.add("a", PROMPT_A + PROMPT_C)  # 8 cached tokens in chunks of 2
    runner.extend("a", [1876, 28, 253])  # the root and two more tokens become cache
    assert runner.cache_len("a") == 11
    logits = runner.forward_trees(["a"], [DraftTree.chain(1345, [2365])])
    (ref,) = reference(model, [PROMPT_A + PROMPT_C + [28, 253, 1345, 2365]])
    torch.testing.assert_close(logits[0], ref[-2:], atol=atol, rtol=0)


def check_batched_prefill(model, atol=ATOL, fused=None):
    """Prompts of different lengths prefilled together (chunks of 3, two requests a forward,
    shorter chunks padded) give each request the logits of its own plain forward; refused
    requests leave the others started."""
    runner = ModelRunner(model, prefill_chunk=3, prefill_tokens=6, fused_forward=fused)
    prompts = {
        "a": PROMPT_A + PROMPT_C,
        "b": PROMPT_B,
        "c": [PROMPT_C[0]],
        "d": PROMPT_C + PROMPT_B,
    }
    bad = {"dup": ("a", [504]), "empty": ("e", []), "oov": ("o", [504, runner.vocab_size])}
    refused = runner.add_batch([*prompts.items(), *bad.values()])
    assert sorted(refused) == ["a", "e", "o"] and all(
        isinstance(e, RunnerError) for e in refused.values()
    )
    assert (
        "already" in str(refused["a"])
        and "empty" in str(refused["e"])
        and "outside" in str(refused["o"])
    )
    assert runner.request_ids == list(prompts) and [runner.cache_len(r) for r in prompts] == [
        len(p) - 1 for p in prompts.values()
    ]
    logits = runner.forward_trees(
        list(prompts), [DraftTree.chain(p[-1], [2365]) for p in prompts.values()]
    )
    refs = reference(model, [p + [2365] for p in prompts.values()])
    for i, ref in enumerate(refs):
        torch.testing.assert_close(logits[i, :2], ref[-2:], atol=atol, rtol=0)


def test_batched_prefill(model):
    check_batched_prefill(model)
    check_batched_prefill(model, fused=True)
    with pytest.raises(RunnerError, match="prefill_chunk"):
        ModelRunner(model, prefill_chunk=8, prefill_tokens=4)


def test_tree_logits_equal_sequential_and_commit_equals_fresh(attn_model):
    check_tree_logits_and_commit(attn_model)


def test_remove_and_add_mid_batch_and_subsets(model):
    check_remove_add_mid_batch_and_subsets(model)


def test_graph_padded_path_on_cpu(model):
    """The inputs a CUDA graph would get (batch and tree padded to power-of-two buckets, idle
    rows) give the same logits as a plain forward; full-batch forwards take that path."""
    check_tree_logits_and_commit(model, graphs="emulated")
    check_remove_add_mid_batch_and_subsets(model, graphs="emulated")
    runner = make_runner(model, "emulated")
    for rid, p in {"a": PROMPT_A, "b": PROMPT_B, "c": PROMPT_C}.items():
        runner.add(rid, p)
    runner.forward_trees(
        list("abc"), [DraftTree.chain(p[-1], [28] * 4) for p in (PROMPT_A, PROMPT_B, PROMPT_C)]
    )
    assert runner._graphs.keys == {(4, 8, 64)}  # 3 requests -> 4 rows, 5 nodes -> 8


@pytest.mark.parametrize("graphs", [False, "emulated"])
def test_forward_returns_the_row_argmax_of_its_logits(model, graphs):
    """``with_argmax``: computed inside the graph's function (emulated) or after an eager
    forward, it is the row argmax of the very logits returned, in the caller's order."""
    from spec_grammar.kernels import row_argmax

    runner = make_runner(model, graphs)
    for rid, p in {"a": PROMPT_A, "b": PROMPT_B}.items():
        runner.add(rid, p)
    trees = [DraftTree.from_parents([26843, 28, 253], [-1, 0, 0]), DraftTree.chain(314, [253, 260])]
    logits, top = runner.forward_trees(["b", "a"], trees, with_argmax=True)
    assert top.shape == (2, 3) and top.dtype == torch.long
    assert torch.equal(top, row_argmax(logits))
    runner.commit("b", [0, 1])
    runner.commit("a", [0])
    plain = runner.forward_trees(["a", "b"], [DraftTree.chain(253, [])] * 2)
    assert plain.shape == (2, 1, runner.vocab_size)  # without the flag: the logits alone


def test_chunked_prefill_and_extend(model):
    check_chunked_prefill_and_extend(model)


def test_fused_decoder_same_checks(model):
    """Every check above with the fused decoder (its torch operations here), graph-padded too."""
    for graphs in (None, "emulated"):
        check_tree_logits_and_commit(model, graphs=graphs, fused=True)
        check_remove_add_mid_batch_and_subsets(model, graphs=graphs, fused=True)
    check_chunked_prefill_and_extend(model, fused=True)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize(
    "attn,dtype,fused",
    [
        ("sdpa", torch.float32, True),
        ("sdpa", torch.float32, False),
        ("eager", torch.float32, False),
        ("sdpa", torch.bfloat16, False),
        ("eager", torch.bfloat16, False),
    ],
)
def test_cuda_same_code(attn, dtype, fused, graphs):
    """The same checks on CUDA, on a 2-layer Llama with SmolLM2's shapes and random weights (the
    mechanics under test do not depend on trained weights; the device may hold no model files),
    with CUDA graphs (full-batch forwards replay graphs, subsets run eagerly) and without, with
    the fused decoder (its Triton kernels) and HF's forward (``attn`` picks HF's attention).
    The tolerance is relative to the logits' scale: 1e-4 in fp32, 3e-2 in bf16. The fused
    decoder's bf16 numerics are checked in ``test_decoder_gpu.py``: its merged GEMMs round
    differently from HF's three (seen: 0.03% of these logits off by up to 1.3x this bf16
    tolerance, with weights at 10x the usual init scale), which says nothing about the
    mechanics checked here; fp32 does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    model.set_attn_implementation(attn)
    scale = float(reference(model, [PROMPT_A])[0].abs().max())
    atol = scale * (1e-4 if dtype == torch.float32 else 3e-2)
    check_tree_logits_and_commit(model, atol, graphs, fused)
    check_remove_add_mid_batch_and_subsets(model, atol, graphs, fused)
    check_chunked_prefill_and_extend(model, atol, fused)
    check_batched_prefill(model, atol, fused)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_window_models(arch):
    """Sliding-window attention is part of the runner's mask: Gemma-3 (per-layer-type masks) and
    Mistral (one windowed mask), tiny random models with a 3-token window, so the checks above
    cross the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=3,
    )
    if arch == "gemma3":
        types = ["sliding_attention", "full_attention", "sliding_attention"]
        config = Gemma3TextConfig(num_hidden_layers=3, layer_types=types, **shape)
        model = Gemma3ForCausalLM(config).eval()
    else:
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, **shape)).eval()
    check_tree_logits_and_commit(model)
    check_remove_add_mid_batch_and_subsets(model)


def test_misuse_raises_runner_error(model):
    runner = ModelRunner(model)
    runner.add("a", [504, 3575, 282])
    with pytest.raises(RunnerError, match="already"):
        runner.add("a", [504])
    with pytest.raises(RunnerError, match="empty"):
        runner.add("e", [])
    with pytest.raises(RunnerError, match="outside"):
        runner.add("e", [504, runner.vocab_size, 282])
    assert runner.request_ids == ["a"]
    with pytest.raises(RunnerError, match="unknown"):
        runner.cache_len("zz")
    with pytest.raises(RunnerError, match="no verified tree"):
        runner.commit("a", [0])
    runner.forward_trees(["a"], [DraftTree.from_parents([282, 4649, 314], [-1, 0, 0])])
    with pytest.raises(RunnerError, match="root path"):
        runner.commit("a", [0, 1, 2])  # siblings, not a path
    with pytest.raises(RunnerError, match="start at the root"):
        runner.commit("a", [1])
    runner.commit("a", [0, 2])
    assert runner.cache_len("a") == 4


def test_kv_store_stacks_layers_and_keeps_odd_ones_apart():
    """Layers of the stacked buffer and layers with their own buffers (another shape, or past the
    declared count) all move positions and rows, and keep their contents when the cache grows."""
    from spec_grammar.worker.runner import _KVStore

    store = _KVStore(torch.device("cpu"), num_layers=2)
    shapes = {
        0: (3, 4),
        1: (3, 4),
        2: (3, 4),
        3: (2, 8),
    }  # layer -> (heads, dim); 2 and 3 stand apart
    bufs = {i: store.layer(i, torch.empty(1, h, 1, d)) for i, (h, d) in shapes.items()}
    assert store.stack is not None and sorted(store.extra) == [2, 3]
    with torch.inference_mode():
        for k, v in bufs.values():
            k.copy_(torch.randn(k.shape))
            v.copy_(torch.randn(v.shape))
    before = {i: (k.clone(), v.clone()) for i, (k, v) in bufs.items()}
    store.move_positions(torch.tensor([1, 2]), torch.tensor([5, 7]), torch.tensor([9, 3]))
    store.move_row(2, 0)
    store.reserve(8, 600)
    for i, (h, d) in shapes.items():
        k, v = store.layer(i, torch.empty(1, h, 1, d))
        assert k.shape == (8, h, 1024, d)
        for new, old in ((k, before[i][0]), (v, before[i][1])):
            expect = old.clone()
            expect[1, :, 9], expect[2, :, 3] = old[1, :, 5], old[2, :, 7]
            expect[0] = expect[2]
            assert torch.equal(new[:4, :, :256], expect), i
            assert not new[4:].any() and not new[:, :, 256:].any()


def test_device_ancestors_equal_the_trees_own():
    """``ancestors`` (pointer doubling on the device) gives each tree's ancestor mask and depths
    (the oracle: ``DraftTree.ancestor_mask`` / ``depth_list``), for padded batches of random
    trees of 1-70 nodes, padding nodes seeing only themselves at depth 0."""
    import random

    from spec_grammar.worker.runner import ancestors

    rng = random.Random(0)
    for n_max in (1, 2, 5, 8, 33, 70):
        trees = [
            DraftTree([0] * n, [-1] + [rng.randrange(i) for i in range(1, n)])
            for n in (rng.randint(1, n_max) for _ in range(6))
        ]
        parents = torch.full((len(trees), n_max), -1, dtype=torch.long)
        for k, t in enumerate(trees):
            parents[k, : t.num_nodes] = torch.tensor(t.parent_list)
        anc, depth = ancestors(parents)
        for k, t in enumerate(trees):
            n = t.num_nodes
            assert torch.equal(anc[k, :n, :n], t.ancestor_mask)
            assert depth[k, :n].tolist() == t.depth_list
            assert (
                torch.equal(anc[k, n:], torch.eye(n_max, dtype=torch.bool)[n:])
                and not depth[k, n:].any()
            )


def test_models_not_on_one_device_are_refused():
    """Offloaded (meta) weights or a model split over devices: a RunnerError naming the problem
    at construction, not a device mismatch inside a forward."""
    from spec_grammar.testing.model_shapes import build_model

    torch.manual_seed(0)
    offloaded = build_model("tiny", "cpu", torch.float32)
    offloaded.model.layers[0].to("meta")
    for device in (None, "cpu"):
        with pytest.raises(RunnerError, match="meta device"):
            ModelRunner(offloaded, device=device)
    with pytest.raises(RunnerError, match="no parameters"):
        ModelRunner(torch.nn.Module())
    # one device: accepted, with or without naming it
    whole = build_model("tiny", "cpu", torch.float32)
    for device in (None, "cpu"):
        assert ModelRunner(whole, device=device).device.type == "cpu"
