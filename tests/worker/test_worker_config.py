"""``WorkerConfig``: the worker's one option list, taken by ``SpecWorker`` (``config=`` or
keywords), ``build_worker`` and ``generate`` (keywords or ``config=``), with the errors the
options always raised; the constructor seams the tests use (``ModelRunner(graphs=)``,
``SpecWorker(placement=, lazy_policy=, early_mask=)``); the shared EAGLE-2 expansion step.

Oracle for the outputs: the same worker built from keywords (temperature 0, float64 tiny
model: token-identical whatever the way the options arrive)."""

from __future__ import annotations

import functools

import pytest
import torch
from emulated_graphs import ReplayEagerly
from spec_grammar_xgrammar import XGrammarBackend

from spec_grammar import JsonSchema, Regex
from spec_grammar.worker import Request, SpecWorker, WorkerConfig, api
from spec_grammar.worker.drafters import DEFAULT_DRAFT, Drafter, NgramDrafter
from spec_grammar.worker.drafters.constrained import DEFAULT_FORCED_TOKENS, GrammarAwareDrafter
from spec_grammar.worker.drafters.model import expand_frontier
from spec_grammar.worker.placement import EarlyMask, GrammarPlacement, LazyGrammar
from spec_grammar.worker.runner import ModelRunner, RunnerError
from spec_grammar.worker.sampling import SamplingParams


@functools.cache
def tiny():
    from spec_grammar.models import load_tokenizer
    from spec_grammar.testing.model_shapes import build_model

    torch.manual_seed(0)
    return build_model("tiny", "cpu", torch.float64), load_tokenizer("smollm2")


@functools.cache
def xgr_backend():
    model, tok = tiny()
    return XGrammarBackend(tok, vocab_size=model.config.vocab_size)


def requests() -> list[Request]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return [
        Request("JSON:", JsonSchema(schema), SamplingParams(max_new_tokens=10), rid="json"),
        Request("Digits:", Regex(r"[0-9]{1,20}"), SamplingParams(max_new_tokens=6), rid="digits"),
        Request("Text:", None, SamplingParams(max_new_tokens=5, ignore_eos=True), rid="plain"),
    ]


def outcome(results) -> dict:
    return {r.rid: (r.token_ids, r.finish_reason) for r in results}


# -- the config ---------------------------------------------------------------------------------
def test_defaults_are_the_documented_ones():
    cfg = WorkerConfig()
    assert cfg.draft == DEFAULT_DRAFT and cfg.forced_tokens is DEFAULT_FORCED_TOKENS
    assert (cfg.topk, cfg.num_steps, cfg.num_draft_tokens) == (1, 4, 8)
    assert cfg.overlap is True and cfg.no_spec is False and cfg.constrain_draft is False
    assert (cfg.grammar_threads, cfg.lazy_grammar, cfg.cuda_graphs, cfg.fused_forward) == (
        None,
        None,
        None,
        None,
    )
    for name, field in WorkerConfig.model_fields.items():  # units and meaning, for every option
        assert field.description, name
    with pytest.raises(ValueError):  # frozen: a worker's options do not change under it
        cfg.overlap = False


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(grammar_threads=0), ValueError, "grammar_threads must be None or an int >= 1, got 0"),
        (dict(grammar_threads=True), ValueError, "grammar_threads must be None or an int >= 1"),
        (dict(lazy_grammar="off"), ValueError, "lazy_grammar must be None, True or False"),
        (dict(cuda_graphs="on"), RunnerError, "cuda_graphs must be None, True or False"),
        (dict(fused_forward=1), RunnerError, "fused_forward must be None, True or False"),
        (dict(overlap="off"), ValueError, "overlap"),
        (dict(topk="two"), ValueError, "topk"),
    ],
)
def test_bad_options_raise_the_errors_they_always_raised(options, error, message):
    with pytest.raises(error, match=message):
        WorkerConfig(**options)
    model, tok = tiny()
    with pytest.raises(error, match=message):
        SpecWorker(model, tok, backend=xgr_backend(), **options)


def test_an_unknown_option_is_a_type_error_before_the_model_loads(monkeypatch):
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    model, tok = tiny()
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_kk'"):
        SpecWorker(model, tok, backend=xgr_backend(), top_kk=2)
    with pytest.raises(TypeError, match=r"^build_worker\(\) got an unexpected keyword argument"):
        api.build_worker(top_kk=2)
    with pytest.raises(TypeError, match=r"^generate\(\) got an unexpected keyword argument"):
        api.generate("hi", top_kk=2)
    with pytest.raises(ValueError, match="grammar_threads"):  # option errors come first too
        api.generate("hi", grammar_threads=0, max_new_tokens=2)


@pytest.mark.integration  # the tiny-model worker end to end for seconds: out of the unit lane
def test_config_and_keywords_give_the_same_worker_and_outputs():
    """``SpecWorker(config=...)``, keywords over a config and keywords alone: the same options,
    the same tokens. Without a config ``forced_tokens`` stays off (a Drafter runs as given)."""
    model, tok = tiny()
    kw = dict(draft="ngram", num_draft_tokens=6, forced_tokens=True, grammar_threads=2)
    with SpecWorker(model, tok, backend=xgr_backend(), **kw) as w:
        want = outcome(w.run(requests()))
        assert isinstance(w.drafter, GrammarAwareDrafter) and w.grammar_threads == 2
    cfg = WorkerConfig(**kw)
    with SpecWorker(model, tok, cfg, backend=xgr_backend()) as w:
        assert w.config is cfg and outcome(w.run(requests())) == want
    base = WorkerConfig(num_draft_tokens=6, grammar_threads=3)
    with SpecWorker(model, tok, base, backend=xgr_backend(), grammar_threads=2) as w:
        assert w.config.grammar_threads == 2 and w.config.forced_tokens is DEFAULT_FORCED_TOKENS
        assert outcome(w.run(requests())) == want
    drafter = NgramDrafter(num_draft_tokens=6)
    with SpecWorker(model, tok, backend=xgr_backend(), draft=drafter) as w:
        assert w.config.forced_tokens is False and w.drafter is drafter
    with pytest.raises(TypeError, match="WorkerConfig"):
        SpecWorker(model, tok, {"overlap": False}, backend=xgr_backend())


# -- the seams ----------------------------------------------------------------------------------
def test_policies_and_graphs_are_constructor_arguments():
    """The policies passed in are the ones asked and fed; a graph store passed to the runner
    replays its full-batch forwards; the outputs equal the default worker without graphs."""
    model, tok = tiny()
    with SpecWorker(model, tok, backend=xgr_backend(), num_draft_tokens=6, overlap=False) as w:
        want = outcome(w.run(requests()))

    class AlternatePlacement(GrammarPlacement):  # thread first
        asked = 0

        def use_thread(self, units):
            self.asked += 1
            return self.asked % 2 == 1

    class AlternateLazy(LazyGrammar):  # lazy first
        asked = 0

        def use_lazy(self, rows, requests, launch_ms, forward_ms):
            self.asked += 1
            return self.asked % 2 == 1

    class CountingEarlyMask(EarlyMask):
        verified = 0

        def record_verify(self, forbidden):
            self.verified += 1
            super().record_verify(forbidden)

    graphs, placement = ReplayEagerly(), AlternatePlacement()
    lazy, early = AlternateLazy(), CountingEarlyMask()
    runner = ModelRunner(model, graphs=graphs)
    assert runner.uses_cuda_graphs
    with SpecWorker(
        runner,
        tok,
        backend=xgr_backend(),
        num_draft_tokens=6,
        placement=placement,
        lazy_policy=lazy,
        early_mask=early,
    ) as w:
        got = outcome(w.run(requests()))
        stats = list(w.step_stats)
    assert got == want
    assert graphs.launches == len(stats) and placement.asked > 0 and lazy.asked > 1
    assert any(s.grammar_in_thread for s in stats) and any(s.lazy_requests for s in stats)
    assert early.verified > 0  # the early-mask policy passed in is the one fed


def test_drafters_declare_their_features():
    assert Drafter.needs_grammar_state is False and NgramDrafter().draft_rows("r", None) is None
    assert GrammarAwareDrafter(NgramDrafter()).needs_grammar_state is True


# -- the EAGLE-2 expansion step -----------------------------------------------------------------
def test_expand_frontier_ranks_by_cumulative_log_prob():
    """Children scored parent + own log-prob, best first (ties in expansion order), ``-inf``
    (masked) children dropped, the ``k`` best as the next frontier."""
    cands: list = []
    front = expand_frontier(cands, [(-1, [-0.1, -1.0, float("-inf")], [5, 6, 7])], k=2)
    assert front == [0, 1] and cands == [(5, -1, -0.1, 1), (6, -1, -1.0, 1)]
    front = expand_frontier(cands, [(0, [-2.0, -0.5], [8, 9]), (1, [-0.2, -0.5], [10, 11])], k=2)
    assert [cands[j][0] for j in front] == [9, 10]  # -0.6, -1.2 (10) before -1.5 (11), -2.1 (8)
    assert [c[3] for c in cands[2:]] == [2, 2, 2, 2]
    assert [c[2] for c in cands[2:]] == pytest.approx([-0.6, -1.2, -1.5, -2.1])
    assert expand_frontier(cands, [(2, [float("-inf")], [1])], k=2) == []  # all masked: done
