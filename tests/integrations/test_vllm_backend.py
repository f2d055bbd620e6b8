"""``spec_grammar.integrations.vllm`` through vLLM's own interfaces, without an engine: the
backend built from a real ``VllmConfig`` and SmolLM2's tokenizer, driven in the order vLLM's
``StructuredOutputManager`` drives it under speculation. Oracle: a fresh matcher of ours
replaying the same accepted prefix. Runs when vLLM is installed (``scripts/test_vllm.sh``);
seconds, no model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import StructuredOutputsConfig, VllmConfig  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.v1.structured_output.backend_types import StructuredOutputOptions as Opt  # noqa: E402

from spec_grammar.errors import (  # noqa: E402
    BackendNotFoundError,
    GrammarCompileError,
    UnsupportedGrammarError,
)
from spec_grammar.integrations import vllm as plugin  # noqa: E402
from spec_grammar.integrations.vllm.backend import (  # noqa: E402
    SpecGrammarVllmBackend,
    validate_request,
)

pytestmark = pytest.mark.vllm

BACKENDS = ["xgrammar", "llguidance", "outlines"]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from spec_grammar.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tok):
    mp = pytest.MonkeyPatch()
    mp.setenv(plugin.BACKEND_ENV, request.param)
    config = VllmConfig(structured_outputs_config=StructuredOutputsConfig(backend="guidance"))
    be = SpecGrammarVllmBackend(config, tokenizer=tok, vocab_size=len(tok))
    mp.undo()
    assert be.backend_name == request.param
    return be


def test_choice_admits_exactly_the_choices(backend, tok):
    choices = ["yes", "no.", "a|b (c)*"]  # regex metacharacters stay literal
    g = backend.compile_grammar(Opt.CHOICE, json.dumps(choices), {tok.eos_token_id})
    for text in choices:
        ids = tok.encode(text) + [tok.eos_token_id]
        g.reset()
        assert g.validate_tokens(ids) == ids, text
        assert g.accept_tokens("r", ids) and g.is_terminated(), text
    for text in ["yes!", "a", "no"]:
        ids = tok.encode(text) + [tok.eos_token_id]
        g.reset()
        assert len(g.validate_tokens(ids)) < len(ids), text


def test_speculative_rows_match_a_fresh_matcher(backend, tok):
    """vLLM's order under speculation: ``validate_tokens`` on the drafts, then per draft a
    ``fill_bitmask`` row and ``accept_tokens``, the bonus row, one ``rollback``; then
    ``accept_tokens`` of what the verifier kept. Each row must equal the row a fresh matcher
    fills after the same prefix."""
    doc = tok.encode('{"name": "Ada", "age": 36}') + [tok.eos_token_id]
    g = backend.compile_grammar(Opt.JSON, json.dumps(PERSON), {tok.eos_token_id})
    ours = g._backend
    bitmask = backend.allocate_token_bitmask(8)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (8, (len(tok) + 31) // 32)
    newline = tok.encode("\n")  # illegal everywhere under the spaced JSON policy
    assert len(newline) == 1
    assert g.accept_tokens("r", doc[:1])
    pos = 0  # doc[: pos + 1] accepted
    while pos + 1 < len(doc):
        drafts = g.validate_tokens(doc[pos + 1 : pos + 5] + newline)
        assert drafts == doc[pos + 1 : pos + 1 + len(drafts)], pos
        # vLLM fills a row only while the grammar is not terminated (else all ones)
        for i, t in enumerate(drafts):
            g.fill_bitmask(bitmask, i)
            assert g.accept_tokens("r", [t])
        if not g.is_terminated():
            g.fill_bitmask(bitmask, len(drafts))  # bonus row
        g.rollback(len(drafts))
        for i in range(len(drafts) + 1):
            fresh = ours.matcher(g._compiled)
            assert fresh.accept_tokens(doc[: pos + 1 + i]) == pos + 1 + i
            if fresh.is_terminated():
                continue
            want = torch.zeros_like(bitmask[:1])
            fresh.fill_next_token_bitmask(want, 0)
            assert torch.equal(bitmask[i], want[0]), (pos, i)
        kept = len(drafts) // 2  # the verifier keeps a prefix, then the bonus token
        assert g.accept_tokens("r", doc[pos + 1 : pos + 2 + kept])
        pos += 1 + kept
    assert g.is_terminated()
    assert g.accept_tokens("r", [5, 6])  # after termination vLLM's tokens are ignored


def test_a_refused_token_returns_false(backend, tok):
    g = backend.compile_grammar(Opt.JSON, json.dumps(PERSON), {tok.eos_token_id})
    assert not g.accept_tokens("r", tok.encode("hello"))
    assert not g.is_terminated()


def test_bad_specs_raise_typed_errors(backend, tok):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(GrammarCompileError):
        backend.compile_grammar(Opt.JSON, json.dumps(bad), {tok.eos_token_id})
    with pytest.raises(UnsupportedGrammarError, match="STRUCTURAL_TAG"):
        backend.compile_grammar(Opt.STRUCTURAL_TAG, "{}", {tok.eos_token_id})


def test_front_end_check_refuses_only_what_does_not_parse():
    def params(**kw):
        return SamplingParams(structured_outputs=StructuredOutputsParams(**kw))

    validate_request(params(json={"$ref": "#/$defs/missing"}))  # the engine decides
    validate_request(params(choice=["a", "b"]))
    with pytest.raises(VLLMValidationError, match="not valid JSON"):
        validate_request(params(json="{not json"))
    with pytest.raises(VLLMValidationError, match="STRUCTURAL_TAG"):
        validate_request(params(structural_tag='{"structures": [], "triggers": []}'))


def test_register_is_opt_in(monkeypatch):
    import vllm.v1.structured_output as manager
    import vllm.v1.structured_output.backend_guidance as guidance

    original = manager.GuidanceBackend
    monkeypatch.setattr(manager, "GuidanceBackend", original)  # restored after the test
    monkeypatch.setattr(guidance, "validate_guidance_grammar", guidance.validate_guidance_grammar)
    monkeypatch.delenv(plugin.BACKEND_ENV, raising=False)
    plugin.register()
    assert manager.GuidanceBackend is original
    monkeypatch.setenv(plugin.BACKEND_ENV, "no_such_backend")
    with pytest.raises(BackendNotFoundError):
        plugin.register()
    monkeypatch.setenv(plugin.BACKEND_ENV, "llguidance")
    plugin.register()
    assert manager.GuidanceBackend is SpecGrammarVllmBackend
    assert guidance.validate_guidance_grammar is validate_request
