"""Valid or told under SGLang (issue 37): our grammar backends built by SGLang's registry, the
request advanced by SGLang's own result processor (``_apply_prefill_grammar``: accept the
token, then ``grammar.finished = req.finished()``), on a schema whose ``uniqueItems``
xgrammar does not enforce. Strict (``SPEC_GRAMMAR_STRICT=1``): SGLang gets its
``InvalidGrammarObject`` naming the keyword. Otherwise: a finished invalid output logs one
WARNING naming the request and the violation (oracle: ``jsonschema``); a valid one and a fully
enforced request log nothing. Skipped without SGLang (``bash scripts/test_sglang.sh``)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import jsonschema
import pytest

pytest.importorskip("sglang")

from sglang.srt.constrained import base_grammar_backend as sgl_base  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor as P,
)

from spec_grammar.integrations.post_check import STRICT_ENV  # noqa: E402
from spec_grammar.integrations.sglang import PREFIX, register  # noqa: E402
from spec_grammar.integrations.sglang.grammar import SGLangGrammar  # noqa: E402

UNIQUE = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
"""xgrammar leaves uniqueItems unenforced and everything else forces ``[1, 1]``: invalid."""
LOGGER = "spec_grammar.integrations.post_check"


def backend(tok, monkeypatch, *, strict: bool):
    register()
    monkeypatch.setenv(STRICT_ENV, "1" if strict else "0")
    init = sgl_base.GRAMMAR_BACKEND_REGISTRY[PREFIX + "xgrammar"]
    return init(SimpleNamespace(), tok, len(tok), {tok.eos_token_id})


def run_to_end(grammar, tok, text: str, rid: str) -> SimpleNamespace:
    """SGLang's per-token path for ``text`` + EOS; the request finishes at EOS."""
    req = SimpleNamespace(grammar=grammar, rid=rid, to_finish=None, done=False)
    req.finished = lambda: req.done
    for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]:
        req.done = t == tok.eos_token_id
        P._apply_prefill_grammar(None, req=req, next_token_id=t)
    assert req.to_finish is None and grammar.is_terminated() and grammar.finished
    return req


def test_strict_gives_sglang_an_invalid_grammar_naming_the_keyword(tok, monkeypatch):
    g = backend(tok, monkeypatch, strict=True).dispatch_json(json.dumps(UNIQUE))
    assert isinstance(g, sgl_base.InvalidGrammarObject)
    assert "strict mode" in g.error_message and "uniqueItems" in g.error_message


def test_an_invalid_finished_output_logs_one_warning(tok, monkeypatch, caplog):
    proto = backend(tok, monkeypatch, strict=False).dispatch_json(json.dumps(UNIQUE))
    assert isinstance(proto, SGLangGrammar) and proto.check is not None
    with pytest.raises(jsonschema.ValidationError, match="non-unique"):  # the oracle's verdict
        jsonschema.validate([1, 1], UNIQUE)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    g = proto.copy()  # what SGLang hands each request
    run_to_end(g, tok, "[1, 1]", "rid-3")
    assert g.valid is False
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "request rid-3: valid=false" in line and "uniqueItems" in line
    assert "/: [1, 1] has non-unique elements" in line


def test_valid_and_fully_enforced_outputs_log_nothing(tok, monkeypatch, caplog):
    be = backend(tok, monkeypatch, strict=False)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ok = be.dispatch_json(json.dumps({**UNIQUE, "items": {"enum": [1, 2]}})).copy()
    run_to_end(ok, tok, "[1, 2]", "ok")
    assert ok.valid is True
    plain = be.dispatch_json(json.dumps({"type": "array", "items": {"const": 1}})).copy()
    assert plain.check is None  # enforced in full: never checked
    run_to_end(plain, tok, "[1, 1]", "plain")
    assert plain.valid is None
    assert not [r for r in caplog.records if r.name == LOGGER]
