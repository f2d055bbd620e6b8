"""Bad worker options, through every door (``WorkerConfig``, ``SpecWorker``, ``build_worker``,
``generate``, the constructor seams): a clear typed error naming the option, raised before any
model loads or any request runs; never a silent coercion, a hang, or an ``AttributeError`` in
the middle of a run.

Oracle for the outputs: temperature-0 outputs do not depend on the drafter (every draft token
is verified), so a worker with capped nonsense tree shapes gives the no-spec tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from emulated_graphs import ReplayEagerly
from pydantic import ValidationError
from spec_grammar_xgrammar import XGrammarBackend

from spec_grammar import Regex
from spec_grammar.worker import Request, SpecWorker, WorkerConfig, api
from spec_grammar.worker.drafters import ModelDrafter, truncated_model
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


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model loaded"))


def requests() -> list[Request]:
    return [
        Request("Digits: 12 12 12", Regex(r"[0-9]{1,20}"), SamplingParams(max_new_tokens=6)),
        Request("Text: a b a b", None, SamplingParams(max_new_tokens=5, ignore_eos=True)),
    ]


def outcome(results) -> list:
    return [(r.token_ids, r.finish_reason, r.error) for r in results]


# -- tree shape ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["topk", "num_steps", "num_draft_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, "3", 3.0, None, float("nan")])
def test_tree_shape_options_are_int_counts(field, value):
    """``topk=True`` used to become 1 and ``"3"`` 3 (every other option refuses bools and
    strings); 0 and negatives passed the config and were caught only by a model drafter (the
    n-gram drafter ignored a bad ``topk``)."""
    with pytest.raises(ValidationError, match=field):
        WorkerConfig(**{field: value})
    model, tok = tiny()
    with pytest.raises(ValueError, match=field):
        SpecWorker(model, tok, backend=xgr_backend(), **{field: value})
    assert getattr(WorkerConfig(**{field: 2}), field) == 2


@pytest.mark.parametrize(
    "draft, message",
    [
        ("bogus", "unknown drafter 'bogus'"),
        ("", "unknown drafter ''"),
        ("model:", "unknown drafter 'model:'"),
        ("self:", "unknown drafter 'self:'"),
        ("self:x", "self:L needs an integer layer count, got 'x'"),
    ],
)
def test_a_drafter_name_of_no_known_form_fails_before_the_model_loads(
    no_model_load, draft, message
):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(draft=draft)
    with pytest.raises(ValueError, match=message):
        api.build_worker(draft=draft)
    with pytest.raises(ValueError, match=message):
        api.generate("hi", draft=draft)


@pytest.mark.parametrize("draft", ["ngram", "grammar", "none", None, "self:2", "model:/a/path"])
def test_drafter_names_of_a_known_form_pass_the_config(draft):
    assert WorkerConfig(draft=draft).draft == draft


@pytest.mark.parametrize(
    "shape",
    [
        dict(topk=10**6),
        dict(num_steps=10**9),
        # a constrained draft of the widest tree: seconds, so in the integration lane
        pytest.param(dict(topk=2**70, constrain_draft=True), marks=pytest.mark.integration),
    ],
)
def test_huge_topk_and_num_steps_draft_no_more_than_a_tree_holds(shape):
    """``self:1`` with ``topk=10**6`` drafted a frontier of the whole vocabulary, and
    ``num_steps=10**9`` a billion draft forwards per step: the run never ended. Both are capped
    at ``num_draft_tokens - 1`` (no candidate past it can enter a tree)."""
    model, tok = tiny()
    with SpecWorker(model, tok, backend=xgr_backend(), no_spec=True) as w:
        want = outcome(w.run(requests()))
    with SpecWorker(model, tok, backend=xgr_backend(), draft="self:1", **shape) as w:
        drafter = w.drafter.inner if hasattr(w.drafter, "inner") else w.drafter
        assert isinstance(drafter, ModelDrafter)
        assert max(drafter.topk, drafter.num_steps) <= w.config.num_draft_tokens - 1
        assert outcome(w.run(requests())) == want


def test_capping_num_steps_keeps_the_trees():
    """A candidate deeper than ``num_draft_tokens - 1`` never enters a tree (it needs all its
    ancestors), so the cap leaves every tree as it was: the same accept lengths."""
    model, tok = tiny()
    runner = ModelRunner(truncated_model(model, 1))

    def run(num_steps):
        drafter = ModelDrafter(runner, topk=2, num_steps=num_steps, num_draft_tokens=4)
        with SpecWorker(model, tok, backend=xgr_backend(), draft=drafter) as w:
            results = w.run(requests())
        return outcome(results), [r.accept_length for r in results]

    assert run(3) == run(50)


# -- the seams ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seam, value, cls",
    [
        ("placement", "thread", "GrammarPlacement"),
        ("placement", object(), "GrammarPlacement"),
        ("lazy_policy", True, "LazyGrammar"),
        ("early_mask", 1, "EarlyMask"),
        ("early_mask", GrammarPlacement(), "EarlyMask"),
    ],
)
def test_a_wrong_policy_object_fails_at_construction(seam, value, cls):
    """They were stored as given, and the first CUDA-graph step died with an AttributeError
    (``'str' object has no attribute 'launch_ms'``), taking the whole batch with it."""
    model, tok = tiny()
    with pytest.raises(TypeError, match=rf"^{seam} must be None or an instance of {cls}"):
        SpecWorker(
            ModelRunner(model, graphs=ReplayEagerly()), tok, backend=xgr_backend(), **{seam: value}
        )


def test_policy_subclasses_are_taken():
    model, tok = tiny()

    class Mine(LazyGrammar):
        pass

    policies = dict(placement=GrammarPlacement(), lazy_policy=Mine(), early_mask=EarlyMask())
    with SpecWorker(model, tok, backend=xgr_backend(), **policies) as w:
        assert w._lazy is policies["lazy_policy"] and w._placement is policies["placement"]


@pytest.mark.parametrize("graphs", [True, False, "emulated", 1, object()])
def test_a_runner_graph_store_must_be_one(graphs):
    """``graphs=True`` (meant as ``cuda_graphs=True``) or ``False`` made ``uses_cuda_graphs``
    True and the first forward died with ``'bool' object has no attribute 'last_events'``."""
    model, _ = tiny()
    with pytest.raises(RunnerError, match="^graphs must be None, a ForwardGraphs or an object"):
        ModelRunner(model, graphs=graphs)
    assert ModelRunner(model, graphs=ReplayEagerly()).uses_cuda_graphs
    assert not ModelRunner(model, graphs=None).uses_cuda_graphs


# -- generate's sampling keywords ---------------------------------------------------------------
class _SamplingOnly:
    """Stands in for the worker: returns each request's sampling params."""

    tokenizer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def run(self, reqs, on_step=None):
        return [r.sampling for r in reqs]


@pytest.fixture
def sampling_of(monkeypatch):
    monkeypatch.setattr(api, "build_worker", lambda **k: _SamplingOnly())

    def call(**kw):
        return api.generate(["x"], chat=False, **kw)[0]

    return call


@pytest.mark.parametrize(
    "stop, want",
    [("END", ["END"]), (None, []), (("a", "b"), ["a", "b"]), (["a"], ["a"]), ([], [])],
)
def test_generate_takes_one_stop_string_or_several(sampling_of, stop, want):
    """``stop="END"`` became ``["E", "N", "D"]``: the output stopped at the first E, N or D."""
    assert sampling_of(stop=stop).stop == want


def test_generate_refuses_a_stop_of_the_wrong_type(sampling_of):
    with pytest.raises(ValidationError, match="stop"):  # was: 'int' object is not iterable
        sampling_of(stop=5)


def test_generate_refuses_a_grammar_of_the_wrong_type_before_the_model_loads(no_model_load):
    with pytest.raises(TypeError, match="a grammar must be a spec"):
        api.generate("hi", grammar=42)


def test_generate_a_bad_prompt_fails_alone(monkeypatch):
    """``generate(["Digits:", 5])`` sent 5 through the chat template after the model had
    loaded: a TypeError ended the whole call. It is that request's error now; token-id prompts
    are taken as they are (the chat template applies to text)."""
    model, tok = tiny()
    monkeypatch.setattr(
        api, "build_worker", lambda **k: SpecWorker(model, tok, k["config"], backend=xgr_backend())
    )
    ids = tok.encode("Digits:", add_special_tokens=False)
    good, bad, as_ids = api.generate(
        ["Digits:", 5, ids], chat=False, grammar=Regex("[0-9]{1,5}"), max_new_tokens=4
    )
    assert (
        bad.finish_reason == "error" and "prompt must be text or a list of token ids" in bad.error
    )
    assert good.finish_reason != "error" and as_ids.token_ids == good.token_ids
    chat_good, chat_bad, chat_ids = api.generate(
        ["Digits:", 5, ids], grammar=Regex("[0-9]{1,5}"), max_new_tokens=4
    )
    assert chat_bad.finish_reason == "error" and chat_good.finish_reason != "error"
    assert chat_ids.token_ids == good.token_ids  # ids: no template, as with chat=False


@pytest.mark.parametrize("name", ["nosuch", "", "half:Missing"])
def test_an_unknown_grammar_backend_fails_before_the_model_loads(no_model_load, name):
    """``build_worker(grammar_backend="nosuch")`` loaded the model first; ``""`` gave a worker
    without a backend (every grammar request then failed)."""
    from spec_grammar.errors import BackendNotFoundError

    with pytest.raises(BackendNotFoundError):
        api.build_worker(grammar_backend=name)
    with pytest.raises(BackendNotFoundError):
        api.generate("hi", grammar_backend=name)


@pytest.mark.parametrize(
    "cls, option, value",
    [
        (GrammarPlacement, "explore_share", "0.5"),
        (GrammarPlacement, "alpha", None),
        (EarlyMask, "margin", "2"),
        (EarlyMask, "min_share", True),
        (LazyGrammar, "hide", True),
        (LazyGrammar, "slack", [0.1]),
        (LazyGrammar, "alpha", float("nan")),
    ],
)
def test_policy_settings_of_the_wrong_type_are_named(cls, option, value):
    """A string or None met a bound comparison and raised a TypeError naming nothing
    ("'<=' not supported between instances of 'float' and 'str'"); True passed for 1."""
    with pytest.raises(ValueError, match=option):
        cls(**{option: value})
