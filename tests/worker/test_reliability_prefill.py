"""Batched prefill under hostile input, on the real SmolLM2: float32 for the runner's logits
(a wrong mask, position or KV row shifts them by O(1), far above float32 noise), float64 where
greedy outputs or top-k draft trees are compared (no near-tie flips between batch shapes).

Oracles: a runner that adds requests one by one (one prefill forward per chunk of one prompt),
a plain cache-free forward of the whole context, and non-speculative decoding of the same
prompts. Covers :meth:`ModelRunner.add_batch` (mixed lengths around the chunk size, rows moved
by removes, pending commits and trees, buffer growth, sliding windows shorter than a chunk,
refused and malformed entries, a forward that raises, bad prefill settings),
:class:`ModelDrafter`'s batched prefill, the worker's handling of refused prompts (numpy ids
accepted, floats and bools refused), duplicate ids, a prefill that raises and a drafter that
raises for one request, and the n-gram drafter's context buffer.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from real_model import backend, model_and_tokenizer, replays

from spec_grammar import Regex
from spec_grammar.tree import DraftTree
from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.drafters import ModelDrafter, NgramDrafter, ngram_tree
from spec_grammar.worker.drafters.model import truncated_model
from spec_grammar.worker.request import RequestState
from spec_grammar.worker.runner import ModelRunner, RunnerError

pytestmark = pytest.mark.model

ATOL = (
    5e-4  # float32 (test_worker_runner's); a wrong mask, position or KV row shifts logits by O(1)
)
MAX_NEW = 8


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread while this file runs (restored after), as in
    test_reliability_exploration: on the busy 2-core CI host a second thread waiting for the
    other core turned 20 ms forwards into 2 s ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompts_of(lengths: list[int], seed: int = 0, prefix: str = "r") -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"{prefix}{i}": [rng.randrange(100, 20000) for _ in range(n)] for i, n in enumerate(lengths)
    }


def probe_trees(prompts: dict[str, list[int]]) -> list[DraftTree]:
    """A branching tree under each request's root: reads the whole cache and scratch."""
    return [DraftTree.from_parents([p[-1], 2365, 28, 253], [-1, 0, 0, 1]) for p in prompts.values()]


def plain(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, its ``(len, V)`` logits of a cache-free forward."""
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]


def one_by_one(model, prompts: dict[str, list[int]]) -> torch.Tensor:
    """The oracle: each prompt prefilled alone, then the probe trees' logits ``(B, 4, V)``."""
    runner = ModelRunner(model)
    for rid, p in prompts.items():
        runner.add(rid, p)
    return runner.forward_trees(list(prompts), probe_trees(prompts))[:, :4]


# lengths around the chunk (4): 1 token (nothing to prefill), exactly a chunk, chunk + 1,
# several chunks, and two requests of equal length
LENGTHS = [1, 4, 5, 13, 2, 8, 9, 1, 4]


@pytest.mark.parametrize(
    "chunk, tokens",
    [(4, 8), (4, 7), (1, 3), (4, 10_000), (13, 13)],
    ids=["2-per-forward", "tokens-not-a-multiple", "chunk-1", "all-in-one", "one-chunk-each"],
)
def test_batched_prefill_equals_one_by_one(model, chunk, tokens):
    prompts = prompts_of(LENGTHS)
    runner = ModelRunner(model, prefill_chunk=chunk, prefill_tokens=tokens)
    # ids as the callers may hand them: a list, a tuple, a numpy array, numpy ints
    entries = [
        (rid, [p, tuple(p), np.array(p), [np.int64(t) for t in p]][i % 4])
        for i, (rid, p) in enumerate(prompts.items())
    ]
    assert runner.add_batch(entries) == {}
    assert runner.request_ids == list(prompts)
    assert [runner.cache_len(r) for r in prompts] == [n - 1 for n in LENGTHS]
    got = runner.forward_trees(list(prompts), probe_trees(prompts))[:, :4]
    torch.testing.assert_close(got, one_by_one(model, prompts), atol=ATOL, rtol=0)


def test_add_batch_after_removes_with_pending_commits_and_buffer_growth(model):
    """Rows moved by removes, commits whose KV moves are still queued, a verified tree not yet
    committed, and a batch that grows the rows (4 -> 16) and the positions (256 -> 512): every
    request's next logits equal a plain forward of its context."""
    runner = ModelRunner(model, prefill_chunk=5, prefill_tokens=15)
    old = prompts_of([6, 3, 7], seed=1)
    ctx = {r: list(p) for r, p in old.items()}
    assert runner.add_batch(list(old.items())) == {}
    branchy = DraftTree.from_parents([0, 2365, 28, 253, 314], [-1, 0, 0, 2, 3])
    trees = [
        DraftTree.from_parents([p[-1], *branchy.token_list[1:]], branchy.parent_list)
        for p in old.values()
    ]
    runner.forward_trees(list(old), trees)
    runner.commit("r0", [0, 2, 3])  # not the first nodes: its KV moves at the next forward
    ctx["r0"] += [28, 253, 9]  # the accepted path, then a bonus token (the next root)
    runner.commit("r1", [0, 2, 3, 4])
    ctx["r1"] += [28, 253, 314, 9]
    # r2's tree stays pending; r0 (row 0) goes: r2 moves into row 0
    runner.remove("r0")
    del ctx["r0"]
    new = prompts_of([300, 1, 4, 5, 9, 2, 11, 6, 3, 1, 7, 8], seed=2, prefix="n")
    assert runner.add_batch(list(new.items())) == {}
    runner.commit("r2", [0, 2, 3, 4])  # the tree verified before the batch joined
    ctx["r2"] += [28, 253, 314, 9]
    ctx.update(new)
    rids = list(ctx)
    assert [runner.cache_len(r) for r in rids] == [len(c) - 1 for c in ctx.values()]
    logits = runner.forward_trees(rids, [DraftTree.chain(c[-1], [2365]) for c in ctx.values()])
    for i, ref in enumerate(plain(model, [c + [2365] for c in ctx.values()])):
        torch.testing.assert_close(logits[i, :2], ref[-2:], atol=ATOL, rtol=0)


def tiny_window_model(arch: str):
    """A random 2-3 layer model with a 3-token sliding window (shorter than the chunks below)."""
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
        return Gemma3ForCausalLM(
            Gemma3TextConfig(num_hidden_layers=3, layer_types=types, **shape)
        ).eval()
    return MistralForCausalLM(MistralConfig(num_hidden_layers=2, **shape)).eval()


@pytest.mark.parametrize("arch, graphs", [("gemma3", False), ("mistral", "emulated")])
def test_batched_prefill_of_sliding_window_models_and_many_requests(arch, graphs):
    """Padded chunks with a window shorter than the chunk (Gemma-3's per-layer-type masks,
    Mistral's one windowed mask); 70 requests (rows 4 -> 128, past the largest graph batch),
    then removes (rows move) and a second batch: every next-token row equals a plain forward.
    (Dropping the window from the mask shifts these rows by ~0.7.)"""
    from emulated_graphs import make_runner

    model = tiny_window_model(arch)
    rng = random.Random(9)
    first = prompts_of([rng.randint(1, 9) for _ in range(70)], seed=10, prefix="a")
    runner = make_runner(model, graphs, prefill_chunk=4, prefill_tokens=40)
    assert runner.add_batch(list(first.items())) == {}
    ctx = dict(first)
    for rid in list(ctx)[::3]:
        runner.remove(rid)
        del ctx[rid]
    second = prompts_of([1, 4, 5, 13, 2], seed=11, prefix="b")
    assert runner.add_batch(list(second.items())) == {}
    ctx.update(second)
    logits = runner.forward_trees(list(ctx), [DraftTree.chain(c[-1], [2365]) for c in ctx.values()])
    refs = plain(model, [c + [2365] for c in ctx.values()])
    atol = 1e-4 * max(float(ref.abs().max()) for ref in refs)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(logits[i, :2], ref[-2:], atol=atol, rtol=0)


BAD_PROMPTS = {
    "text": ("123", "sequence of ints"),
    "none-prompt": (None, "sequence of ints"),
    "float": ([504, 1.5], "1.5 is not an int"),
    "integral-float": ([504, 3.0], "3.0 is not an int"),
    "nan": ([float("nan")], "nan is not an int"),
    "inf": ([float("inf")], "inf is not an int"),
    "str-id": ([504, "7"], "'7' is not an int"),
    "none-id": ([None], "None is not an int"),
    "bool": ([True, 504], "True is not an int"),
    "numpy-bool": ([np.bool_(False)], "is not an int"),
    "numpy-float": ([np.float64(2.0)], "is not an int"),
    "negative": ([504, -1], "outside"),
    "vocab": ([504, 49152], "outside"),
    "huge": ([10**30], "outside"),
    "huge-uint64": ([np.uint64(2**63)], "outside"),
    "empty": ([], "empty"),
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_a_bad_prompt_is_refused_and_the_others_start(model, name):
    """(When written, a non-int id raised ValueError / TypeError out of ``add_batch`` with the
    requests before it registered but never prefilled (cache length 0, no KV), and their ids
    blocked; 1.5 was truncated to 1, the text "123" read as ids 1, 2, 3, True as 1.)"""
    prompt, reason = BAD_PROMPTS[name]
    runner = ModelRunner(model, prefill_chunk=2, prefill_tokens=4)
    good = prompts_of([5, 1, 3], seed=3)
    entries = [("r0", good["r0"]), ("bad", prompt), ("r1", good["r1"]), ("r2", good["r2"])]
    refused = runner.add_batch(entries)
    assert list(refused) == ["bad"] and isinstance(refused["bad"], RunnerError)
    assert reason in str(refused["bad"]), refused["bad"]
    assert runner.request_ids == list(good)
    got = runner.forward_trees(list(good), probe_trees(good))[:, :4]
    torch.testing.assert_close(got, one_by_one(model, good), atol=ATOL, rtol=0)
    with pytest.raises(RunnerError, match="not an int|sequence of ints|outside|empty"):
        runner.add("bad", prompt)
    if name not in ("empty", "negative", "vocab", "huge", "huge-uint64", "none-prompt"):
        with pytest.raises(RunnerError, match="not an int|sequence of ints"):
            runner.extend("r0", prompt)
        assert runner.cache_len("r0") == 4


@pytest.mark.parametrize(
    "entry", [(["unhashable"], [504, 28]), ("r9", [504], "extra"), None], ids=repr
)
def test_a_malformed_entry_raises_and_leaves_none_of_the_call(model, entry):
    runner = ModelRunner(model, prefill_chunk=2, prefill_tokens=4)
    runner.add("old", [504, 3575, 282])
    before = runner.forward_trees(["old"], [DraftTree.chain(282, [4649])])
    batch = prompts_of([4, 1, 6], seed=4)
    with pytest.raises((TypeError, ValueError)):
        runner.add_batch([*batch.items(), entry])
    assert runner.request_ids == ["old"]
    assert runner.add_batch(list(batch.items())) == {}  # the ids are free again
    after = runner.forward_trees(["old"], [DraftTree.chain(282, [4649])])
    torch.testing.assert_close(after, before, atol=ATOL, rtol=0)
    got = runner.forward_trees(list(batch), probe_trees(batch))[:, :4]
    torch.testing.assert_close(got, one_by_one(model, batch), atol=ATOL, rtol=0)


class FailingRunner(ModelRunner):
    """A real runner whose ``fail_at``-th forward from now raises (an out-of-memory stand-in)."""

    fail_at: int | None = None

    def _forward(self, *args, **kwargs):
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at == 0:
                raise RuntimeError("injected forward failure")
        return super()._forward(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_forward_failing_mid_prefill_leaves_none_of_the_call(model, fail_at):
    """The batch needs several forwards (chunks of 2, two requests a forward); whichever one
    raises, the call's requests are all gone, the older requests (one with a commit whose KV
    moves were still queued, rows moved by a remove) are untouched, and the same batch can be
    added again."""
    runner = FailingRunner(model, prefill_chunk=2, prefill_tokens=4)
    old = {"a": [504, 3575, 282, 4649, 314], "b": [2705, 827, 1296], "c": [26843]}
    assert runner.add_batch(list(old.items())) == {}
    runner.forward_trees(["a"], [DraftTree.from_parents([314, 28, 253], [-1, 0, 0])])
    runner.commit("a", [0, 2])  # moves node 2's KV: queued until the next forward
    runner.remove("b")  # c moves into b's row
    ctx = {"a": old["a"] + [253, 9], "c": old["c"]}  # accepted 253, bonus 9
    batch = prompts_of([7, 3, 6, 1, 5], seed=5)
    runner.fail_at = fail_at
    with pytest.raises(RuntimeError, match="injected"):
        runner.add_batch(list(batch.items()))
    assert runner.request_ids == ["a", "c"]
    assert [runner.cache_len(r) for r in ctx] == [len(c) - 1 for c in ctx.values()]
    assert runner.add_batch(list(batch.items())) == {}
    ctx.update(batch)
    logits = runner.forward_trees(list(ctx), [DraftTree.chain(c[-1], [2365]) for c in ctx.values()])
    for i, ref in enumerate(plain(model, [c + [2365] for c in ctx.values()])):
        torch.testing.assert_close(logits[i, :2], ref[-2:], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(prefill_chunk=0),
        dict(prefill_chunk=-4),
        dict(prefill_tokens=0),
        dict(prefill_tokens=-1),
        dict(prefill_chunk=8, prefill_tokens=7),
        dict(prefill_chunk=1.5),
        dict(prefill_chunk="8"),
        dict(prefill_tokens=None),
        dict(prefill_chunk=True),
        dict(prefill_tokens=float("inf")),
    ],
    ids=repr,
)
def test_bad_prefill_settings_are_a_runner_error_naming_them(model, kw):
    with pytest.raises(RunnerError, match="prefill_"):
        ModelRunner(model, **kw)


# -- the drafter's batched prefill ----------------------------------------------------------


def draft_model():
    """The first 2 layers of the shared float64 SmolLM2 (weights shared, nothing copied)."""
    return truncated_model(model_and_tokenizer()[0], 2)


def states_of(prompts: dict[str, list[int]]) -> list[RequestState]:
    return [RequestState(Request(p, rid=r), list(p), None) for r, p in prompts.items()]


def test_model_drafter_batched_prefill_drafts_the_trees_of_one_by_one():
    """Trees of several steps (committing each tree's first-child path) from a drafter whose
    prompts were prefilled together equal those of one whose prompts went in one by one; a
    refused request is returned by id and its removal is a no-op."""
    prompts = prompts_of([1, 3, 4, 5, 9, 2], seed=6)
    batched = ModelDrafter(
        ModelRunner(draft_model(), prefill_chunk=3, prefill_tokens=7), topk=2, num_steps=3
    )
    single = ModelDrafter(ModelRunner(draft_model()), topk=2, num_steps=3)
    sb, ss = states_of(prompts), states_of(prompts)
    bad = RequestState(Request([504, -3], rid="bad"), [504, -3], None)
    refused = batched.add_batch([*sb[:3], bad, *sb[3:]])
    assert list(refused) == ["bad"] and "outside" in str(refused["bad"])
    batched.remove("bad")
    batched.remove("never-added")
    for s in ss:
        single.add(s)
    for _ in range(3):
        tb, ts = batched.propose(sb), single.propose(ss)
        assert [(t.token_list, t.parent_list) for t in tb] == [
            (t.token_list, t.parent_list) for t in ts
        ]
        for b, s, t in zip(sb, ss, tb):
            node = t.parent_list.index(0, 1) if t.num_nodes > 1 else None
            nxt = t.token_list[node] if node is not None else 28
            b.output_ids.append(nxt)
            s.output_ids.append(nxt)


# -- the worker -----------------------------------------------------------------------------


def sampling(n: int = MAX_NEW) -> dict:
    return dict(max_new_tokens=n)


@pytest.fixture(scope="module")
def good_requests():
    """Mixed prompt lengths around the test runners' chunk (4): 1 id, exactly 4, 5, 13, text."""
    tok = model_and_tokenizer()[1]
    ids = prompts_of([1, 4, 5, 13], seed=7)
    reqs = [Request(p, sampling=sampling(), rid=r) for r, p in ids.items()]
    reqs.append(Request("The capital of France is", sampling=sampling(), rid="text"))
    reqs.append(
        Request(
            "Answer with a number: 17 + 25 =",
            grammar=Regex(r" ?[0-9]+"),
            sampling=sampling(),
            rid="rx",
        )
    )
    assert len(tok.encode("The capital of France is")) > 1
    return reqs


@pytest.fixture(scope="module")
def plain_outputs(good_requests):
    """Oracle: non-speculative greedy decoding, requests prefilled one by one."""
    model, tok = model_and_tokenizer()
    runner = ModelRunner(model, prefill_tokens=512)  # one request per prefill forward
    with SpecWorker(runner, tok, backend=backend("xgrammar"), no_spec=True) as w:
        return {r.rid: (r.token_ids, r.finish_reason) for r in w.run(good_requests)}


def spec_worker(drafter="self") -> SpecWorker:
    """Target and draft runners with small prefill chunks (several forwards per batch), both
    :class:`FailingRunner` (no fault unless armed)."""
    model, tok = model_and_tokenizer()
    if drafter == "self":
        drafter = ModelDrafter(
            FailingRunner(draft_model(), prefill_chunk=3, prefill_tokens=7),
            topk=2,
            num_steps=3,
            num_draft_tokens=6,
        )
    return SpecWorker(
        FailingRunner(model, prefill_chunk=4, prefill_tokens=9),
        tok,
        backend=backend("xgrammar"),
        draft=drafter,
    )


def test_worker_batched_prefill_refused_and_duplicate_ids_end_only_their_request(
    good_requests, plain_outputs
):
    """Hostile requests among good ones end with their reason; the good ones equal plain
    decoding; nothing stays in the runners and the same ids run again, also after a run whose
    prefill raised in the target's or the drafter's batched prefill. (When written, a
    duplicate id ended BOTH requests with "already in the runner" and left the first one's KV
    row in the runner for good: every later run with that id failed.)"""
    worker = spec_worker()
    hostile = [
        Request([504, 49152], sampling=sampling(), rid="oov"),
        Request([-5, 504], sampling=sampling(), rid="negative"),
        Request([], sampling=sampling(), rid="empty"),
        Request([504, 28], sampling=sampling(), rid="r1"),  # the id of a good request
        Request([504, 2.0], sampling=sampling(), rid="float"),
        Request([True, 504], sampling=sampling(), rid="bool"),
    ]
    # numpy ids are ids: the same output as the list prompt (when written: refused, "got list")
    as_numpy = Request(
        [np.int64(t) for t in good_requests[0].prompt], sampling=sampling(), rid="numpy"
    )
    reqs = [
        *good_requests[:2],
        hostile[0],
        *good_requests[2:4],
        *hostile[1:],
        as_numpy,
        *good_requests[4:],
    ]
    runners = (worker.runner, worker.drafter.runner)
    with worker:
        results = worker.run(reqs)
        assert [r.request_ids for r in runners] == [[], []]
        for failing in runners:  # the 2nd forward of the batched prefill raises
            failing.fail_at = 2
            with pytest.raises(RuntimeError, match="injected"):
                worker.run(good_requests)
            assert [r.request_ids for r in runners] == [[], []]
        again = {r.rid: (r.token_ids, r.finish_reason) for r in worker.run(good_requests)}
    got = {}
    for req, res in zip(reqs, results):
        if req in hostile:
            assert res.finish_reason == "error" and res.token_ids == [], res
            continue
        got[res.rid] = (res.token_ids, res.finish_reason)
    errors = {req.rid: res.error for req, res in zip(reqs, results) if req in hostile}
    assert "49152" in errors["oov"] and "outside" in errors["oov"]
    assert "-5" in errors["negative"] and "empty" in errors["empty"]
    assert "already used by another request" in errors["r1"]
    assert "must be ints, got 2.0" in errors["float"] and "must be ints, got True" in errors["bool"]
    assert got.pop("numpy") == plain_outputs[good_requests[0].rid]
    assert got == plain_outputs and again == plain_outputs


def fails(batch, victim: str) -> bool:
    """Whether the injected drafting fault fires: for ``victim`` once it has 2 output tokens,
    or (``victim="batch"``) for every batch of more than one request."""
    if victim == "batch":
        return len(batch) > 1
    return any(s.rid == victim and len(s.output_ids) >= 2 for s in batch)


@pytest.mark.parametrize("rid", [5, ("t",), ["unhashable"]], ids=repr)
def test_a_request_id_that_is_not_a_string_ends_only_that_request(rid):
    """(When written: the worker ran the whole batch and then raised pydantic's ValidationError
    building the int / tuple id's result, losing every request's output; a list id raised
    TypeError from the prefill.)"""
    model, tok = model_and_tokenizer()
    reqs = [
        Request([504, 3575, 282], sampling=sampling(2), rid=rid),
        Request([2705, 827], sampling=sampling(2), rid="ok"),
    ]
    with SpecWorker(model, tok, backend=None, draft="ngram") as worker:
        bad, ok = worker.run(reqs)
        assert worker.runner.request_ids == []
    assert (
        bad.finish_reason == "error"
        and "request id must be a string" in bad.error
        and bad.rid == repr(rid)
    )
    with SpecWorker(model, tok, backend=None, no_spec=True) as worker:
        (want,) = worker.run(reqs[1:])
    assert (
        ok.finish_reason == "length" and ok.token_ids == want.token_ids and len(ok.token_ids) == 2
    )


class NgramFailingFor(NgramDrafter):
    """The n-gram drafter, raising when :func:`fails`."""

    def __init__(self, victim: str, **kw):
        super().__init__(**kw)
        self.victim = victim

    def propose(self, batch):
        if fails(batch, self.victim):
            raise RuntimeError(f"injected drafting fault for {self.victim}")
        return super().propose(batch)


class ModelDrafterFailingFor(ModelDrafter):
    """A draft-model drafter raising in its second draft forward (after the catch-up forward
    committed every request's tokens and left a tree pending) when :func:`fails`."""

    def __init__(self, runner, victim: str, **kw):
        super().__init__(runner, **kw)
        self.victim = victim

    def forward_spines(self, batch, *args):
        if fails(batch, self.victim):
            raise RuntimeError(f"injected drafting fault for {self.victim}")
        return super().forward_spines(batch, *args)


@pytest.mark.parametrize(
    "kind, victim",  # r2: no grammar; rx: a grammar request with tokens still to feed its matcher
    [("ngram", "r2"), ("ngram", "rx"), ("ngram", "batch"), ("model", "rx"), ("model", "batch")],
)
def test_a_drafter_raising_for_one_request_ends_only_that_request(
    good_requests, plain_outputs, kind, victim
):
    """The victim ends with "drafting failed: ..." keeping its committed tokens (a prefix of its
    plain output, accepted by a fresh matcher for the grammar request); the others equal plain
    decoding; no request stays in either runner. A fault of every batched call (each request
    alone drafts fine) ends nobody: the retry one request at a time gives plain outputs."""
    model, _ = model_and_tokenizer()
    if kind == "ngram":
        drafter = NgramFailingFor(victim, num_draft_tokens=6)
    else:
        drafter = ModelDrafterFailingFor(
            ModelRunner(draft_model(), prefill_chunk=3, prefill_tokens=7),
            victim,
            topk=2,
            num_steps=3,
            num_draft_tokens=6,
        )
    with spec_worker(drafter) as worker:
        results = {r.rid: r for r in worker.run(good_requests)}
        assert worker.runner.request_ids == []
        if kind == "model":
            assert drafter.runner.request_ids == []
    if victim == "batch":
        assert {rid: (r.token_ids, r.finish_reason) for rid, r in results.items()} == plain_outputs
        return
    bad = results.pop(victim)
    assert bad.finish_reason == "error" and bad.error.startswith(
        "drafting failed: RuntimeError: injected"
    ), bad
    want = plain_outputs[victim][0]
    assert 2 <= len(bad.token_ids) < len(want) and bad.token_ids == want[: len(bad.token_ids)]
    spec = next(r.grammar for r in good_requests if r.rid == victim)
    if spec is not None:
        assert replays("xgrammar", spec, bad.token_ids, finished=False)
    assert {rid: (r.token_ids, r.finish_reason) for rid, r in results.items()} == {
        rid: out for rid, out in plain_outputs.items() if rid != victim
    }


# -- the n-gram drafter's context buffer ----------------------------------------------------


def test_committed_array_follows_the_context_through_every_growth():
    """A long prompt, then appends of 0, 1 and many tokens (past twice the buffer at once): the
    array equals the list every time, and the tree built from it equals the tree of the list."""
    rng = random.Random(8)
    prompt = [rng.randrange(5) for _ in range(150)]
    state = RequestState(Request(prompt, rid="x"), list(prompt), None)
    for n in [0, 1, 0, 3, 500, 1, 2000, 0, 64, 7]:
        state.output_ids.extend(rng.randrange(5) + 49000 for _ in range(n))
        arr = state.committed_array()
        assert arr.dtype == np.int64 and arr.tolist() == state.committed_ids
        t_arr = NgramDrafter(num_draft_tokens=9).propose([state])[0]
        t_list = ngram_tree(state.committed_ids, 9)
        assert (t_arr.token_list, t_arr.parent_list) == (t_list.token_list, t_list.parent_list)
    empty = RequestState(Request([], rid="e"), [], None)
    assert empty.committed_array().tolist() == []
    one = RequestState(Request([7], rid="o"), [7], None)
    tree = NgramDrafter(num_draft_tokens=9).propose([one])[0]
    assert tree.token_list == [7] and one.committed_array().tolist() == [7]
