"""``spec_grammar.integrations.vllm`` through vLLM's own interfaces, without an engine: the
backend built from a real ``VllmConfig`` and SmolLM2's tokenizer, driven in the order vLLM's
``StructuredOutputManager`` drives it under speculation. Oracle: a fresh matcher of ours
replaying the same accepted prefix. Runs when vLLM is installed (``scripts/test_vllm.sh``);
seconds, no model."""

from __future__ import annotations

import json
import logging

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
    GrammarSpecError,
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
    mp.setenv(plugin.WHITESPACE_ENV, "spaced")  # the row test needs an illegal newline
    config = VllmConfig(structured_outputs_config=StructuredOutputsConfig(backend="guidance"))
    be = SpecGrammarVllmBackend(config, tokenizer=tok, vocab_size=len(tok))
    mp.undo()
    assert be.backend_name == request.param and be.whitespace == "spaced"
    return be


@pytest.mark.parametrize(
    ("env", "disable_any", "want"),
    [(None, False, "flexible"), (None, True, "compact"), ("spaced", False, "spaced")],
)
def test_json_whitespace_follows_vllms_rule_unless_chosen(tok, monkeypatch, env, disable_any, want):
    """vLLM's own backends allow any JSON whitespace unless ``disable_any_whitespace``; ours
    does the same by default, and ``$SPEC_GRAMMAR_VLLM_WHITESPACE`` picks another policy.
    Oracle: what the compiled grammar accepts."""
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    if env is None:
        monkeypatch.delenv(plugin.WHITESPACE_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.WHITESPACE_ENV, env)
    cfg = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=disable_any)
    be = SpecGrammarVllmBackend(
        VllmConfig(structured_outputs_config=cfg), tokenizer=tok, vocab_size=len(tok)
    )
    assert be.whitespace == want
    assert be.closed_objects  # vLLM's xgrammar rule for objects, by default
    g = be.compile_grammar(Opt.JSON, json.dumps(PERSON), {tok.eos_token_id})
    accepts = {}
    for text in [
        '{"name": "A", "age": 3}',
        '{"name":"A","age":3}',
        '{\n  "name": "A",\n  "age": 3\n}',
    ]:
        ids = tok.encode(text) + [tok.eos_token_id]
        g.reset()
        accepts[text] = g.validate_tokens(ids) == ids
    assert (
        list(accepts.values())
        == {
            "flexible": [True, True, True],
            "compact": [False, True, False],
            "spaced": [True, False, False],
        }[want]
    ), accepts


def test_an_unknown_whitespace_stops_the_engine_at_start(tok, monkeypatch):
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    monkeypatch.setenv(plugin.WHITESPACE_ENV, "loose")
    config = VllmConfig(structured_outputs_config=StructuredOutputsConfig(backend="guidance"))
    with pytest.raises(ValueError, match="SPEC_GRAMMAR_VLLM_WHITESPACE"):
        SpecGrammarVllmBackend(config, tokenizer=tok, vocab_size=len(tok))


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


def test_a_refused_token_returns_false_and_leaves_the_state_unchanged(backend, tok, caplog):
    """vLLM 0.34's contract: a False ``accept_tokens`` leaves the grammar as it was. Oracle: the
    bitmask row before and after equals a fresh matcher's after the same prefix."""
    g = backend.compile_grammar(Opt.JSON, json.dumps(PERSON), {tok.eos_token_id})
    prefix = tok.encode('{"name": "Ada"')
    assert g.accept_tokens("r", prefix)
    before = backend.allocate_token_bitmask(1)
    g.fill_bitmask(before, 0)
    caplog.set_level(logging.DEBUG, logger="spec_grammar.integrations.vllm.backend")
    # legal tokens, then an illegal one: atomic, the legal ones are undone
    bad = tok.encode(', "age": 3') + tok.encode("hello")
    assert not g.accept_tokens("r", bad)
    after = backend.allocate_token_bitmask(1)
    g.fill_bitmask(after, 0)
    fresh = g._backend.matcher(g._compiled)
    fresh.accept_tokens(prefix)
    want = backend.allocate_token_bitmask(1)
    fresh.fill_next_token_bitmask(want, 0)
    assert torch.equal(after, want) and torch.equal(before, want)
    assert not g.is_terminated()
    # a commit the grammar refuses is a warning; vLLM 0.34's probe of a cut draft's first
    # illegal token (one token right after its bitmask row) is expected: debug
    levels = [r.levelno for r in caplog.records if "refused" in r.getMessage()]
    assert levels == [logging.WARNING], levels
    caplog.clear()
    g.fill_bitmask(after, 0)
    assert not g.accept_tokens("r", tok.encode("hello")[:1])
    levels = [r.levelno for r in caplog.records if "refused" in r.getMessage()]
    assert levels == [logging.DEBUG], levels


def test_bad_specs_raise_typed_errors(backend, tok):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(GrammarCompileError):
        backend.compile_grammar(Opt.JSON, json.dumps(bad), {tok.eos_token_id})
    with pytest.raises(GrammarSpecError, match="structural_tag"):
        backend.compile_grammar(Opt.STRUCTURAL_TAG, "{}", {tok.eos_token_id})
    qwen_xml = {
        "format": {
            "type": "tag",
            "begin": "<f>",
            "end": "</f>",
            "content": {"type": "qwen_xml_parameter", "json_schema": {}},
        }
    }
    with pytest.raises(UnsupportedGrammarError, match="qwen_xml"):
        backend.compile_grammar(Opt.STRUCTURAL_TAG, json.dumps(qwen_xml), {tok.eos_token_id})


def test_front_end_check_refuses_only_what_does_not_parse():
    def params(**kw):
        return SamplingParams(structured_outputs=StructuredOutputsParams(**kw))

    validate_request(params(json={"$ref": "#/$defs/missing"}))  # the engine decides
    validate_request(params(choice=["a", "b"]))
    with pytest.raises(VLLMValidationError, match="not valid JSON"):
        validate_request(params(json="{not json"))
    with pytest.raises(VLLMValidationError, match="no tags"):
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


def test_the_start_line_names_the_version_and_what_runs(monkeypatch, caplog):
    import vllm.v1.structured_output as manager
    import vllm.v1.structured_output.backend_guidance as guidance

    from spec_grammar.integrations.vllm import versions

    monkeypatch.setattr(manager, "GuidanceBackend", manager.GuidanceBackend)
    monkeypatch.setattr(guidance, "validate_guidance_grammar", guidance.validate_guidance_grammar)
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    caplog.set_level(logging.INFO, logger="spec_grammar.integrations.vllm")
    plugin.register()
    version = versions.installed_version()
    assert versions.line_for(version) == ("v0_32", True)
    (line,) = [r for r in caplog.records if "spec-grammar on vLLM" in r.getMessage()]
    assert line.levelno == logging.INFO
    assert f"vLLM {version}: backend: on" in line.getMessage()
    assert "drafter: on (method='custom_class'" in line.getMessage()


def test_an_untested_version_gets_one_warning_and_no_crash(monkeypatch, caplog):
    """A version outside the tested lines runs the line whose interfaces it has; a part that
    fails to set up is reported off in the one start line, the rest runs."""
    import vllm.v1.structured_output as manager
    import vllm.v1.structured_output.backend_guidance as guidance

    from spec_grammar.integrations.vllm import versions

    monkeypatch.setattr(manager, "GuidanceBackend", manager.GuidanceBackend)
    monkeypatch.setattr(guidance, "validate_guidance_grammar", guidance.validate_guidance_grammar)
    monkeypatch.setattr(versions, "installed_version", lambda: "0.33.1")
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    caplog.set_level(logging.INFO, logger="spec_grammar.integrations.vllm")
    report = versions.register_for_installed("xgrammar")
    assert dict((p, on) for p, on, _ in report) == {"backend": True, "drafter": True}
    assert manager.GuidanceBackend is SpecGrammarVllmBackend
    # the backend's module attributes gone: reported off, no exception
    monkeypatch.delattr(guidance, "validate_guidance_grammar")
    caplog.clear()
    report = versions.register_for_installed("xgrammar")
    assert [(p, on) for p, on, _ in report] == [("backend", False), ("drafter", True)]
    (line,) = [r for r in caplog.records if "untested" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "vLLM 0.33.1 is untested" in line.getMessage()
    assert "backend: off" in line.getMessage() and "validate_guidance_grammar" in line.getMessage()
