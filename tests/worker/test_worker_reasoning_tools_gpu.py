"""Reasoning requests and tagged tool calls through the speculative worker on CUDA: the
overlapped step, CUDA graphs with lazy verification and the strictly ordered step give the same
tokens at temperature 0, and every output replays on a fresh matcher under the same rules
(random-weight SmolLM2-shaped target, real SmolLM2 tokenizer, xgrammar)."""

import os

import pytest
import torch

from spec_grammar.compose import matcher as compose_matcher
from spec_grammar.datasets import bfcl_cases
from spec_grammar.reasoning import ReasoningGrammar
from spec_grammar.specs import JsonSchema, ToolCalls
from spec_grammar.testing.model_shapes import build_model
from spec_grammar.worker.engine import SpecWorker
from spec_grammar.worker.request import Request
from spec_grammar.worker.runner import ModelRunner
from spec_grammar.worker.sampling import SamplingParams

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def setup():
    from spec_grammar.models import load_tokenizer
    from spec_grammar.registry import get_backend

    torch.manual_seed(0)
    model = build_model("smollm2-135m", "cuda", torch.bfloat16, num_hidden_layers=4)
    tok = load_tokenizer(os.environ.get("SPEC_GRAMMAR_TOKENIZER", "smollm2"))
    backend = get_backend("xgrammar", tok, vocab_size=model.config.vocab_size)
    return model, tok, backend


def _requests():
    tools = bfcl_cases()[0]["tools"]
    params = SamplingParams(max_new_tokens=48)
    return [
        Request(
            "Think, then JSON:",
            JsonSchema(SCHEMA),
            params,
            rid="r0",
            reasoning_end="</think>",
            max_reasoning_tokens=4,
        ),
        Request(
            "Think more:",
            JsonSchema(SCHEMA),
            params,
            rid="r1",
            reasoning_end="</think>",
            max_reasoning_tokens=12,
        ),
        Request("Call a tool:", ToolCalls(tools, tool_choice="auto"), params, rid="t0"),
        Request("Call it:", ToolCalls(tools, format="tagged", max_tool_calls=2), params, rid="t1"),
    ]


def _run(setup, *, overlap: bool, graphs: bool, lazy: bool | None):
    model, tok, backend = setup
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
        return w.run(_requests())


def test_reasoning_and_tool_calls_on_cuda(setup):
    _, _, backend = setup
    want = _run(setup, overlap=False, graphs=False, lazy=False)
    for overlap, graphs, lazy in ((True, False, False), (True, True, False), (True, True, True)):
        got = _run(setup, overlap=overlap, graphs=graphs, lazy=lazy)
        assert [(r.token_ids, r.finish_detail) for r in got] == [
            (r.token_ids, r.finish_detail) for r in want
        ], (overlap, graphs, lazy)
    for req, res in zip(_requests(), want):
        assert res.finish_detail in ("grammar", "length"), res.error
        m = compose_matcher(backend, backend.compile(req.grammar))
        if req.reasoning_end is not None:
            m = ReasoningGrammar(
                m, req.reasoning_end, max_reasoning_tokens=req.max_reasoning_tokens
            )
        assert m.accept_tokens(res.token_ids) == len(res.token_ids)  # oracle: a fresh matcher
        if res.finish_detail == "grammar":
            assert m.accept_token(backend.tokenizer_info.stop_token_ids[0])
