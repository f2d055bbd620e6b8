"""Valid or told under vLLM (issue 37): vLLM 0.32's own ``StructuredOutputManager`` drives our
backend on a schema whose ``uniqueItems`` xgrammar does not enforce. Strict
(``SPEC_GRAMMAR_STRICT=1``): the request's grammar fails to compile, naming the keyword (vLLM
then finishes that request with an error). Otherwise: a completed invalid output logs one
WARNING naming the request and the violation (oracle: ``jsonschema``); a valid one, a draft's
termination the bitmask pass rolls back, and a fully enforced request log nothing. Runs with
vLLM installed (``scripts/test_vllm.sh``)."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

pytest.importorskip("vllm")

from vllm.config import DeviceConfig, ModelConfig, StructuredOutputsConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from spec_grammar.errors import UnsupportedGrammarError  # noqa: E402
from spec_grammar.integrations import vllm as plugin  # noqa: E402
from spec_grammar.integrations.post_check import STRICT_ENV  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.model]

UNIQUE = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
"""xgrammar leaves uniqueItems unenforced and everything else forces ``[1, 1]``: invalid."""
UNIQUE_OK = {**UNIQUE, "items": {"enum": [1, 2]}}
LOGGER = "spec_grammar.integrations.post_check"


@pytest.fixture(scope="module")
def tok():
    from spec_grammar.models import load_tokenizer

    return load_tokenizer("smollm2")


def manager_for(model_dir: str, monkeypatch, *, strict: bool) -> StructuredOutputManager:
    monkeypatch.setenv(plugin.BACKEND_ENV, "xgrammar")
    monkeypatch.setenv(STRICT_ENV, "1" if strict else "0")
    plugin.register()
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model_dir, dtype="float32", max_model_len=256),
        structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
    )
    return StructuredOutputManager(config)


def new_request(req_id: str, tok, schema) -> Request:
    params = SamplingParams(
        temperature=0,
        stop_token_ids=[tok.eos_token_id],
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    params.structured_outputs._backend = "guidance"  # what vLLM's front end records
    return Request(req_id, tok.encode("List:"), params, None)


def init_grammar(manager: StructuredOutputManager, request: Request):
    """vLLM's grammar init; the grammar, or the compile's exception (what the scheduler meets)."""
    manager.grammar_init(request)
    so = request.structured_output_request
    g = so._grammar
    if hasattr(g, "result"):
        e = g.exception()
        return e if e is not None else g.result()
    return g


def test_strict_refuses_at_compile_naming_the_keyword(model_dir, tok, monkeypatch):
    manager = manager_for(model_dir, monkeypatch, strict=True)
    refused = init_grammar(manager, new_request("strict-1", tok, UNIQUE))
    assert isinstance(refused, UnsupportedGrammarError), refused
    assert "strict mode" in str(refused) and "uniqueItems" in str(refused)


def test_an_invalid_completed_output_logs_one_warning(model_dir, tok, monkeypatch, caplog):
    manager = manager_for(model_dir, monkeypatch, strict=False)
    request = new_request("req-7", tok, UNIQUE)
    grammar = init_grammar(manager, request)
    text = "[1, 1]"
    with pytest.raises(jsonschema.ValidationError, match="non-unique"):  # the oracle's verdict
        jsonschema.validate(json.loads(text), UNIQUE)
    out = tok.encode(text) + [tok.eos_token_id]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert manager.accept_tokens(request, out[:2])
    # a draft reaching the stop token: the bitmask pass accepts it, then rolls it back
    manager.grammar_bitmask({"req-7": request}, ["req-7"], {"req-7": out[2:]})
    assert not grammar.is_terminated() and grammar.valid is None
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert manager.accept_tokens(request, out[2:])  # the verifier keeps the draft: committed
    assert grammar.is_terminated() and grammar.valid is False
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "request req-7: valid=false" in line and "uniqueItems" in line
    assert "/: [1, 1] has non-unique elements" in line


def test_valid_and_fully_enforced_outputs_log_nothing(model_dir, tok, monkeypatch, caplog):
    manager = manager_for(model_dir, monkeypatch, strict=False)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ok = new_request("ok", tok, UNIQUE_OK)
    grammar = init_grammar(manager, ok)
    assert manager.accept_tokens(ok, tok.encode("[1, 2]") + [tok.eos_token_id])
    assert grammar.is_terminated() and grammar.valid is True
    enforced = new_request("enforced", tok, {"type": "array", "items": {"const": 1}})
    plain = init_grammar(manager, enforced)
    assert plain._path is None  # nothing unenforced: no tokens kept, no check
    assert manager.accept_tokens(enforced, tok.encode("[1, 1]") + [tok.eos_token_id])
    assert plain.is_terminated() and plain.valid is None
    assert not [r for r in caplog.records if r.name == LOGGER]
