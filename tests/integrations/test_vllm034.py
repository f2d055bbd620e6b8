"""The plugin against vLLM 0.34's real Python classes (``scripts/test_vllm034.sh``: vLLM 0.34.0
installed with ``--no-deps`` beside CPU torch; its engine needs CUDA torch 2.14 and cannot run
here). What imports on a CPU runs: the plugin's registration (the one start line, vLLM's
speculator registry), ``SpeculativeConfig`` validation of ``method="spec_grammar"``, vLLM's
``StructuredOutputManager`` driving our backend (its grammar init, draft trim, bitmask pass and
commits), and the drafter's bookkeeping on the engine's grammars. Oracles: a fresh matcher of
ours replaying the same tokens, vLLM's own config resolution, our backend's compile counter.
Not run: ``GrammarNgramSpeculator`` inside a model runner (vLLM's ``RequestState`` needs pinned
CUDA memory, its n-gram kernel Triton on a GPU). Skipped unless vLLM 0.34 is installed."""

from __future__ import annotations

import json
import logging

import pytest

vllm = pytest.importorskip("vllm")
if not str(getattr(vllm, "__version__", "")).startswith("0.34."):
    pytest.skip("needs vLLM 0.34 (scripts/test_vllm034.sh)", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.speculator_config import (  # noqa: E402
    registered_speculative_methods,
)

from spec_grammar.integrations import vllm as plugin  # noqa: E402
from spec_grammar.integrations.vllm import versions  # noqa: E402
from spec_grammar.integrations.vllm.backend import SpecGrammarVllmBackend  # noqa: E402
from spec_grammar.integrations.vllm.shared import live_grammar  # noqa: E402
from spec_grammar.integrations.vllm.speculator import (  # noqa: E402
    GrammarDrafts,
    GrammarNgramSpeculator,
)
from spec_grammar.integrations.vllm.speculator_config import (  # noqa: E402
    GrammarNgramSpeculatorConfig,
)

pytestmark = [pytest.mark.vllm, pytest.mark.model]

K = 4
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
DOC = '{"name": "Ada Lovelace", "age": 36, "city": "London"}'


@pytest.fixture(scope="module", params=["xgrammar", "llguidance", "outlines"])
def backend_name(request):
    mp = pytest.MonkeyPatch()
    mp.setenv(plugin.BACKEND_ENV, request.param)
    plugin.register()
    yield request.param
    mp.undo()


@pytest.fixture(scope="module")
def tok():
    from spec_grammar.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def vllm_config(model_dir, backend_name):
    model = ModelConfig(model_dir, dtype="float32", max_model_len=256)
    spec = SpeculativeConfig(
        method=plugin.DRAFTER_METHOD,
        num_speculative_tokens=K,
        prompt_lookup_max=4,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=model,
        speculative_config=spec,
        structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
    )


def test_register_names_the_line_and_registers_the_drafter(monkeypatch, caplog):
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    caplog.set_level(logging.INFO, logger="spec_grammar.integrations.vllm")
    plugin.register()
    assert versions.line_for(versions.installed_version()) == ("v0_34", True)
    (line,) = [r for r in caplog.records if "spec-grammar on vLLM 0.34" in r.getMessage()]
    assert "backend: on" in line.getMessage()
    assert "drafter: on (speculative_config.method='spec_grammar')" in line.getMessage()
    assert plugin.DRAFTER_METHOD in registered_speculative_methods()
    plugin.register()  # vLLM calls it in every process: idempotent
    import vllm.v1.structured_output as manager

    assert manager.GuidanceBackend is SpecGrammarVllmBackend


def test_vllm_resolves_the_method_to_our_speculator(vllm_config):
    spec = vllm_config.speculative_config
    assert spec.custom_method == plugin.DRAFTER_METHOD and spec.method == "ngram"
    assert type(spec.speculator_config) is GrammarNgramSpeculatorConfig
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    cls = resolve_obj_by_qualname(spec.speculator_config.speculator_class)
    assert cls is GrammarNgramSpeculator and issubclass(cls, BaseSpeculator)
    # what 0.34 did to the 0.32 drafter's configuration
    with pytest.raises(ValueError, match="Unknown speculative method"):
        SpeculativeConfig(method="custom_class", num_speculative_tokens=K)


def new_request(req_id: str, tok, prompt: str, **structured) -> Request:
    params = SamplingParams(
        temperature=0,
        stop_token_ids=[tok.eos_token_id],
        structured_outputs=StructuredOutputsParams(**structured),
    )
    params.structured_outputs._backend = "guidance"  # what vLLM's front end records
    return Request(req_id, tok.encode(prompt), params, None)


def init_grammar(manager: StructuredOutputManager, request: Request):
    manager.grammar_init(request)
    so = request.structured_output_request
    so._grammar = so._grammar.result() if hasattr(so._grammar, "result") else so._grammar
    return so.grammar


def test_the_manager_drives_our_backend_as_0_34_documents(vllm_config, tok, caplog):
    """vLLM 0.34's StructuredOutputManager on our backend: the draft trim keeps the first
    illegal token, the bitmask pass then probes it (refused, state unchanged, debug log), the
    rows equal a fresh matcher's, and the commit advances the grammar."""
    manager = StructuredOutputManager(vllm_config)
    request = new_request("r1", tok, "Copy: " + DOC, json=PERSON)
    grammar = init_grammar(manager, request)
    assert isinstance(manager.backend, SpecGrammarVllmBackend)
    doc = tok.encode(DOC) + [tok.eos_token_id]
    assert manager.accept_tokens(request, doc[:3])
    bad = [tok.eos_token_id]  # illegal before the document is complete
    drafts = doc[3:5] + bad + doc[6:7]
    trimmed = manager.trim_spec_tokens(request, list(drafts))
    assert trimmed == doc[3:5] + bad  # 0.34 keeps the first illegal token
    caplog.set_level(logging.DEBUG, logger="spec_grammar.integrations.vllm.backend")
    bitmask = manager.grammar_bitmask({"r1": request}, ["r1"], {"r1": trimmed})
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert [r.levelno for r in refusals] == [logging.DEBUG], [r.getMessage() for r in refusals]
    ours = manager.backend._backend_for({tok.eos_token_id})
    for i in range(3):  # rows after the committed prefix and each legal draft; then all-ones
        fresh = ours.matcher(grammar.compiled)
        fresh.accept_tokens(doc[: 3 + i])
        want = torch.zeros((1, bitmask.shape[1]), dtype=torch.int32)
        fresh.fill_next_token_bitmask(want, 0)
        assert np.array_equal(bitmask[i], want[0].numpy()), i
    assert (bitmask[3] == -1).all() and (bitmask[4] == -1).all()
    # the grammar state is back at the committed prefix: the verifier keeps 2 drafts + bonus
    assert manager.accept_tokens(request, doc[3:6])
    fresh = ours.matcher(grammar.compiled)
    fresh.accept_tokens(doc[:6])
    a, b = (torch.zeros((1, bitmask.shape[1]), dtype=torch.int32) for _ in range(2))
    grammar.fill_bitmask(a, 0)
    fresh.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b)
    # a commit the grammar refuses: False, the state unchanged, a warning
    caplog.clear()
    assert not manager.accept_tokens(request, doc[6:8] + bad)
    grammar.fill_bitmask(a, 0)
    assert torch.equal(a, b)
    assert [r.levelno for r in caplog.records if "refused" in r.getMessage()] == [logging.WARNING]


def test_drafter_bookkeeping_on_the_engines_grammars(vllm_config, tok, caplog):
    """The speculator's per-request half on what the manager leaves: the engine's grammar is
    found by request id after its first commit (no second compile), each draft is the legal
    prefix of the n-gram draft + forced tokens (a fresh matcher's), ``-1`` padded; a request
    the engine's grammar does not know gets the n-gram draft; a broken one falls back, logged
    once; finished requests are forgotten."""
    manager = StructuredOutputManager(vllm_config)
    req = new_request("json", tok, "Copy: " + DOC, json=PERSON)
    grammar = init_grammar(manager, req)
    ours = manager.backend._backend_for({tok.eos_token_id})
    compiles = ours.num_compiles
    doc = tok.encode(DOC) + [tok.eos_token_id]
    drafts_obj = GrammarDrafts(K)
    assert drafts_obj.rows_with_grammar(["json", "free"]) == []  # not advanced yet
    committed = doc[:1]
    assert manager.accept_tokens(req, committed)
    assert live_grammar("json") is grammar
    assert drafts_obj.rows_with_grammar(["free", "json"]) == [1]
    cut = forced = 0
    pos = 1
    # the n-gram draft copies the prompt, which says "town" where the schema requires
    # "city": the draft is cut there and the grammar forces the key instead
    copy = tok.encode(DOC.replace("city", "town")) + [tok.eos_token_id]
    assert len(copy) == len(doc)
    while pos < len(doc) - 1:
        ngram = (copy[pos : pos + K] + [0] * K)[:K]
        table = np.array([[7] * K, ngram], dtype=np.int64)
        out = drafts_obj.refine(table, ["free", "json"], [1], [np.array(doc[:pos])])
        assert out[0].tolist() == [7] * K  # rows without a grammar keep the n-gram draft
        m = ours.matcher(grammar.compiled)
        m.accept_tokens(doc[:pos])
        legal = ngram[: m.validate_tokens(ngram)]
        m.accept_tokens(legal)
        want = (legal + m.forced_tokens())[:K]
        assert out[1].tolist() == want + [-1] * (K - len(want)), pos
        cut += len(legal) < len(ngram)
        forced += len(want) > len(legal)
        kept = 0
        while kept < len(want) and want[kept] == doc[pos + kept]:
            kept += 1
        step = doc[pos : pos + kept + 1]
        assert manager.accept_tokens(req, step)
        pos += len(step)
    assert cut > 0
    assert forced > 0 or manager.backend.backend_name == "outlines"
    assert ours.num_compiles == compiles  # the engine's compile, shared
    # a history the grammar refuses: n-gram draft, logged once
    caplog.set_level(logging.WARNING, logger="spec_grammar.integrations.vllm.speculator")
    table = np.array([[1, 2, 3, 4]], dtype=np.int64)
    bad = np.array(tok.encode("hello"))
    for _ in range(2):
        out = drafts_obj.refine(table, ["json"], [0], [bad])
        assert out.tolist() == table.tolist()
    assert drafts_obj.rows_with_grammar(["json"]) == []  # on n-gram drafts from now on
    assert sum("falls back" in r.getMessage() for r in caplog.records) == 1
    drafts_obj.forget({"json"})
    assert drafts_obj._states == {} and drafts_obj._failed == set()


def test_tool_calls_through_the_manager(vllm_config, tok):
    """vLLM 0.34's hermes tool parser's structural tag (its own builder) compiles on our
    backend; a call in either of its layouts is accepted to the end."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    chat = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "2+3"}],
        tools=tools,
        tool_choice="required",
    )
    tag = get_model_structural_tag(
        model="hermes", tools=chat.tools, tool_choice=chat.tool_choice, reasoning=False
    )
    manager = StructuredOutputManager(vllm_config)
    for i, text in enumerate(
        [
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        ]
    ):
        req = new_request(f"t{i}", tok, "2+3", structural_tag=json.dumps(tag.model_dump()))
        grammar = init_grammar(manager, req)
        ids = tok.encode(text) + [tok.eos_token_id]
        assert manager.accept_tokens(req, ids), text
        assert grammar.is_terminated()


def test_the_speculator_stays_off_without_our_backend(vllm_config, monkeypatch, caplog):
    """Without ``$SPEC_GRAMMAR_VLLM_BACKEND`` no request runs on our backend: the speculator
    says so at start and passes vLLM's n-gram drafts through."""
    monkeypatch.delenv(plugin.BACKEND_ENV)
    caplog.set_level(logging.WARNING, logger="spec_grammar.integrations.vllm.speculator")

    class Ngram:  # stands for vLLM's NgramGPUSpeculator, which needs Triton on a GPU
        def propose(self, *args, **kwargs):
            return torch.tensor([[5, 6, 7, 8]])

    s = GrammarNgramSpeculator(vllm_config, torch.device("cpu"), req_states=None, ngram=Ngram())
    assert not s.enabled and "SPEC_GRAMMAR_VLLM_BACKEND is unset" in caplog.text
    out = s.propose(None, None, None, None, None, torch.tensor([1]), None, None, None, None, None)
    assert out.tolist() == [[5, 6, 7, 8]]
