"""The grammar-aware vLLM drafter (``spec_grammar.integrations.vllm.drafter``) without an engine:
vLLM's real ``InputBatch`` / ``CachedRequestState`` / ``SamplingParams`` / ``VllmConfig``,
updated between steps the way the model runner does it (``GPUModelRunner._bookkeeping_sync``),
a verifier that keeps the drafts matching a known document. Oracles: vLLM's own
``NgramProposer`` for requests without a grammar, and a fresh matcher of ours replaying the
committed tokens for the rest (the legal n-gram prefix + the forced tokens after it). Runs
when vLLM is installed (``scripts/test_vllm.sh``); seconds, the model directory only for its
config and tokenizer."""

from __future__ import annotations

import copy
import json
import logging

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.v1.spec_decode.ngram_proposer import NgramProposer  # noqa: E402
from vllm.v1.structured_output.backend_types import StructuredOutputOptions as Opt  # noqa: E402
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from spec_grammar.integrations import vllm as plugin  # noqa: E402
from spec_grammar.integrations.vllm.backend import SpecGrammarVllmBackend  # noqa: E402
from spec_grammar.integrations.vllm.drafter import (  # noqa: E402
    GrammarNgramProposer,
    find_model_runner,
)

pytestmark = [pytest.mark.vllm, pytest.mark.model]

K = 4
PROPOSER = "spec_grammar.integrations.vllm.drafter.GrammarNgramProposer"
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
# the prompt's copy says "town" where the schema requires "city": the n-gram draft runs into
# it and is cut there; the grammar forces the key instead
PROMPT = 'Copy: {"name": "Ada Lovelace", "age": 36, "town": "London"}\n'
DOC = '{"name": "Ada Lovelace", "age": 36, "city": "London"}'


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    model = ModelConfig(model_dir, dtype="float32", max_model_len=256)
    spec = SpeculativeConfig(
        method="custom_class",
        model=PROPOSER,
        num_speculative_tokens=K,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        model_config=model,
        speculative_config=spec,
        structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
    )


@pytest.fixture(scope="module")
def tok():
    from spec_grammar.models import load_tokenizer

    return load_tokenizer("smollm2")


class Runner:
    """The two pieces of model-runner state the drafter reads (``GPUModelRunner.input_batch``
    and ``.requests``), holding vLLM's real classes."""

    def __init__(self, vocab_size: int):
        self.input_batch = InputBatch(
            max_num_reqs=4,
            max_model_len=256,
            max_num_batched_tokens=256,
            device=torch.device("cpu"),
            vocab_size=vocab_size,
            block_sizes=[16],
            max_num_blocks_per_req=[16],
        )
        self.requests: dict[str, CachedRequestState] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        state = CachedRequestState(
            req_id=req_id,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=params,
            generator=None,
            block_ids=([],),
            num_computed_tokens=0,
            output_token_ids=[],
        )
        self.requests[req_id] = state
        self.input_batch.add_request(state)

    def commit(self, sampled: list[list[int]]) -> None:
        """Append each row's sampled tokens, as ``GPUModelRunner._bookkeeping_sync`` does."""
        batch = self.input_batch
        for row, ids in enumerate(sampled):
            if not ids:
                continue
            start = int(batch.num_tokens_no_spec[row])
            batch.token_ids_cpu[row, start : start + len(ids)] = ids
            batch.num_tokens_no_spec[row] = start + len(ids)
            self.requests[batch.req_ids[row]].output_token_ids.extend(ids)

    def output(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)


def params(tok, **structured) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        stop_token_ids=[tok.eos_token_id],
        structured_outputs=StructuredOutputsParams(**structured) if structured else None,
    )


def plain_ngram(vllm_config) -> NgramProposer:
    cfg = copy.copy(vllm_config)
    cfg.speculative_config = copy.copy(vllm_config.speculative_config)
    cfg.speculative_config.prompt_lookup_min = cfg.speculative_config.prompt_lookup_max = 4
    return NgramProposer(cfg)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_drafts_follow_the_grammar_through_rejections_and_row_moves(
    vllm_config, tok, monkeypatch, caplog, backend
):
    monkeypatch.setenv(plugin.BACKEND_ENV, backend)
    runner = Runner(len(tok))
    prompt = tok.encode(PROMPT)
    doc = tok.encode(DOC) + [tok.eos_token_id]
    runner.add("json", prompt, params(tok, json=PERSON))
    runner.add("free", prompt, params(tok))
    runner.add("broken", prompt, params(tok, json=PERSON))  # its output is not JSON
    drafter = GrammarNgramProposer(vllm_config, runner=runner)
    ngram = plain_ngram(vllm_config)
    oracle = SpecGrammarVllmBackend(vllm_config, tokenizer=tok, vocab_size=len(tok))
    compiled = oracle.compile_grammar(Opt.JSON, json.dumps(PERSON), {doc[-1]})

    def expected(output: list[int], ngram_draft: list[int]) -> tuple[list[int], int]:
        m = oracle._backend_for({doc[-1]}).matcher(compiled._compiled)
        assert m.accept_tokens(output) == len(output)
        legal = ngram_draft[: m.validate_tokens(ngram_draft)]
        m.accept_tokens(legal)
        return (legal + m.forced_tokens())[:K], len(legal)

    caplog.set_level(logging.WARNING, logger="spec_grammar.integrations.vllm.drafter")
    sampled = [doc[:1], tok.encode("Hi"), tok.encode("hello")]
    forced_steps = cut_steps = 0
    step = 0
    while True:
        runner.commit(sampled)
        batch = runner.input_batch
        args = (sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
        drafts = drafter.propose(*args)
        plain = ngram.propose(K, *args)
        rows = {r: i for i, r in enumerate(batch.req_ids)}
        i = rows["json"]
        out = runner.output("json")
        if out[-1] == doc[-1]:
            assert drafts[i] == []  # terminated: nothing to draft
            break
        want, n_legal = expected(out, plain[i])
        assert drafts[i] == want, (step, out)
        forced_steps += len(want) > n_legal
        cut_steps += n_legal < len(plain[i])
        assert drafts[rows["free"]] == plain[rows["free"]]
        assert drafts[rows["broken"]] == plain[rows["broken"]]  # fell back to plain n-gram
        # the verifier keeps the drafts that match the document, then the bonus token
        pos = len(out)
        kept = 0
        while kept < len(drafts[i]) and drafts[i][kept] == doc[pos + kept]:
            kept += 1
        nxt = [[] for _ in rows]
        nxt[i] = doc[pos : pos + kept + 1]
        nxt[rows["free"]] = tok.encode(" x")
        nxt[rows["broken"]] = tok.encode(" y")
        sampled = nxt
        step += 1
        if step == 2:  # vLLM reorders rows (condense / swap): the mapping follows req_ids
            batch.swap_states(0, 2)
            sampled = [sampled[2], sampled[1], sampled[0]]
    assert runner.output("json") == doc
    assert cut_steps > 0
    # outlines-core forces a token only where it is the one legal token (its DFA works on
    # tokens): every key and separator of this document has several tokenizations
    assert forced_steps > 0 or backend == "outlines"
    assert step < len(doc) - 1  # drafts were accepted: fewer steps than tokens
    # the broken request's failure was logged once, however many steps it drafted
    fails = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(fails) == 1, [r.getMessage() for r in caplog.records]


def test_finished_requests_are_forgotten(vllm_config, tok, monkeypatch):
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    runner = Runner(len(tok))
    runner.add("a", tok.encode(PROMPT), params(tok, json=PERSON))
    drafter = GrammarNgramProposer(vllm_config, runner=runner)
    sampled = [tok.encode("{")]
    runner.commit(sampled)
    drafter.propose(
        sampled, runner.input_batch.num_tokens_no_spec, runner.input_batch.token_ids_cpu
    )
    assert set(drafter._states) == {"a"}
    runner.input_batch.remove_request("a")
    del runner.requests["a"]
    drafter.propose([], runner.input_batch.num_tokens_no_spec, runner.input_batch.token_ids_cpu)
    assert drafter._states == {}


def test_the_runner_is_found_on_the_constructor_stack(vllm_config):
    class Runner(GPUModelRunner):  # vLLM's class; its __init__ builds the drafter
        def __init__(self, config):
            self.drafter = GrammarNgramProposer(config)

    runner = Runner(vllm_config)
    assert runner.drafter.runner is runner
    assert find_model_runner() is None  # not inside a runner's constructor


def test_a_reasoning_parser_turns_grammar_drafting_off(vllm_config, tok, monkeypatch, caplog):
    """The engine's grammar starts after the reasoning, which the drafter cannot see: every
    request gets vLLM's plain n-gram draft."""
    config = copy.copy(vllm_config)
    config.structured_outputs_config = StructuredOutputsConfig(
        backend="guidance", reasoning_parser="deepseek_r1"
    )
    runner = Runner(len(tok))
    runner.add("json", tok.encode(PROMPT), params(tok, json=PERSON))
    drafter = GrammarNgramProposer(config, runner=runner)
    assert "reasoning parser" in caplog.text
    sampled = [tok.encode('{"name": "Ada Lovelace", "age": 36, "')]
    runner.commit(sampled)
    args = (sampled, runner.input_batch.num_tokens_no_spec, runner.input_batch.token_ids_cpu)
    assert drafter.propose(*args) == plain_ngram(vllm_config).propose(K, *args)


def test_a_runner_without_the_batch_falls_back_to_plain_ngram(vllm_config, tok, caplog):
    """A vLLM whose runner keeps its batch elsewhere: plain n-gram drafts, logged once, no
    exception into the engine."""
    runner = Runner(len(tok))
    runner.add("a", tok.encode(PROMPT), params(tok, json=PERSON))
    drafter = GrammarNgramProposer(vllm_config, runner=object())
    sampled = [tok.encode('{"name": "Ada Lovelace", "age": 36, "')]
    runner.commit(sampled)
    args = (sampled, runner.input_batch.num_tokens_no_spec, runner.input_batch.token_ids_cpu)
    plain = plain_ngram(vllm_config).propose(K, *args)
    assert drafter.propose(*args) == plain
    assert drafter.propose(*args) == plain
    assert caplog.text.count("has no input_batch") == 1


def test_the_drafter_shares_the_engines_compile(vllm_config, tok, monkeypatch):
    """In one process (vLLM's scheduler and model runner in the engine process) the drafter's
    backend is the engine's: a spec the engine compiled is not compiled again. Oracle: the
    backend's own compile counter."""
    from vllm.tokenizers import cached_tokenizer_from_config

    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    model_config = vllm_config.model_config
    engine = SpecGrammarVllmBackend(
        vllm_config,
        tokenizer=cached_tokenizer_from_config(model_config=model_config),
        vocab_size=model_config.get_vocab_size(),
    )
    eos = {tok.eos_token_id}
    engine.compile_grammar(Opt.JSON, json.dumps(PERSON), eos)
    ours = engine._backend_for(eos)
    compiles = ours.num_compiles
    runner = Runner(len(tok))
    runner.add("a", tok.encode(PROMPT), params(tok, json=PERSON))
    drafter = GrammarNgramProposer(vllm_config, runner=runner)
    sampled = [tok.encode('{"name": "Ada')]
    runner.commit(sampled)
    batch = runner.input_batch
    drafter.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
    assert set(drafter._states) == {"a"}
    assert drafter._backend._backend_for(eos) is ours
    assert ours.num_compiles == compiles
