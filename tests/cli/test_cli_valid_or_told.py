"""Valid or told (issue 37), as a new user meets it in ``spec-grammar generate``: a strict
refusal, an unsupported grammar and an unknown backend are told before the model loads (tests
without the ``model`` marker fail if it loads); an output breaking its schema exits 4 with
``valid: false`` and the violation; a budget past the model's context is clamped, said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from spec_grammar.cli import main
from spec_grammar.cli.generate import INVALID_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
UNIQUE = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
"""No backend enforces uniqueItems, and everything else forces ``[1, 1]``: invalid for sure."""


def test_strict_refusal_is_told_before_the_model_loads(capsys):
    rc = main(["generate", "--strict", "--json-schema", json.dumps(UNIQUE), "hi"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "strict mode" in err and "uniqueItems" in err and "backends that would take it" in err


def test_refusal_under_json_is_a_record_on_stdout(capsys):
    """A pipeline reading ``--json`` stdout gets the refusal as JSON, not an empty stream."""
    rc = main(["generate", "--json", "--strict", "--json-schema", json.dumps(UNIQUE), "hi"])
    out = capsys.readouterr().out
    assert rc == 2
    record = json.loads(out)
    assert record["exit_code"] == 2 and "uniqueItems" in record["error"]
    assert record["error_type"] == "UnsupportedGrammarError"


def test_strict_batch_lines_refused_alone_without_a_model_load(capsys, tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        json.dumps({"prompt": "a", "json_schema": UNIQUE, "strict": True})
        + "\n"
        + json.dumps({"prompt": "b", "regex": "a", "strict": "yes"})
        + "\n"
    )
    rc = main(["generate", "--batch-file", str(batch), "--json"])
    out, _err = capsys.readouterr()
    res = {r["rid"]: r for r in json.loads(out)["results"]}
    assert rc == 1
    assert "strict mode" in res["line-1"]["error"] and res["line-1"]["valid"] is None
    assert "strict must be true or false" in res["line-2"]["error"]


def test_unsupported_grammar_names_the_backends_that_take_it(capsys, tmp_path):
    g = tmp_path / "a.gbnf"
    g.write_text('root ::= "a"\n')
    rc = main(["generate", "--grammar-backend", "outlines", "--ebnf", str(g), "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "ebnf grammars are not supported" in err
    assert "backends that would take it: xgrammar, llguidance" in err


def test_unknown_backend_is_told_before_torch_is_imported():
    code = (
        "import sys\nfrom spec_grammar.cli import main\n"
        "rc = main(['generate', '--grammar-backend', 'nope', '--regex', 'a', 'hi'])\n"
        "print('RC', rc, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "adapters")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "RC 2 False" in out.stdout, out.stdout + out.stderr
    assert "unknown grammar backend 'nope'; registered: auto" in out.stderr


@pytest.mark.parametrize(
    ("flags", "told"),
    [
        (
            ["--strict", "--json-schema", json.dumps(UNIQUE)],
            ["[auto] strict mode", "backends that would take it: none registered"],
        ),
        (
            ["--grammar-backend", "xgrammar", "--strict", "--json-schema", json.dumps(UNIQUE)],
            ["[xgrammar] strict mode: 1 keyword use(s) would not be enforced: uniqueItems at /"],
        ),
        (
            ["--grammar-backend", "outlines", "--ebnf", "G"],
            ["[outlines] ebnf grammars are not", "would take it: xgrammar, llguidance"],
        ),
        (["--json-schema", '{"type": "strng"}'], ["[auto]", "'strng' is not valid"]),
    ],
)
def test_refusals_are_told_before_torch_is_imported(flags, told, tmp_path):
    """A strict refusal, an unclaimed kind and an invalid schema, decided from the backends'
    declarations (read from source): torch, the grammar libraries and the tokenizer are not
    loaded (was 18 s on a loaded host, the model's libraries imported first)."""
    g = tmp_path / "a.gbnf"
    g.write_text('root ::= "a"\n')
    argv = [str(g) if f == "G" else f for f in flags]
    code = (
        "import sys\nfrom spec_grammar.cli import main\n"
        f"rc = main(['generate', *{argv!r}, 'hi'])\n"
        "print('RC', rc, [m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "adapters")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "RC 2 []" in out.stdout, out.stdout + out.stderr
    assert all(t in out.stderr for t in told), out.stderr


@pytest.mark.model
def test_an_output_breaking_its_schema_exits_4_valid_false(capsys, tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        json.dumps({"prompt": "Two ones.", "json_schema": UNIQUE})
        + "\n"
        + json.dumps({"prompt": "Is water wet? yes or no", "regex": "(yes|no)"})
        + "\n"
    )
    rc = main(["generate", "--batch-file", str(batch), "--json", "--max-new-tokens", "100000000"])
    out, err = capsys.readouterr()
    res = {r["rid"]: r for r in json.loads(out)["results"]}
    assert rc == INVALID_EXIT_CODE, err
    bad = res["line-1"]
    with pytest.raises(jsonschema.ValidationError):  # the oracle agrees: invalid
        jsonschema.validate(json.loads(bad["text"]), UNIQUE)
    assert bad["valid"] is False and bad["finish_reason"] == "stop"
    assert bad["finish_detail"] == "violation" and bad["violations"][0]["keyword"] == "uniqueItems"
    assert bad["backend"] and bad["backend_reason"]
    assert res["line-2"]["valid"] is True and res["line-2"]["finish_detail"] == "grammar"
    assert any("line-1" in ln and "invalid" in ln for ln in err.splitlines()), err
    clamped = [ln for ln in err.splitlines() if "clamped" in ln]
    assert clamped and "max_new_tokens=100000000" in clamped[0]


def test_a_prompt_past_the_context_is_told_before_the_model_loads(capsys):
    from spec_grammar.worker.api import model_context_length

    context = model_context_length("smollm2")
    if context is None:
        pytest.skip("no saved config of the model yet (a GGUF model before its first load)")
    rc = main(["generate", "--json", "--regex", "(yes|no)", "word " * (context + 100)])
    out, err = capsys.readouterr()
    [res] = json.loads(out)["results"]
    assert rc == 1 and res["finish_reason"] == "error"
    assert f"the model's context is {context} tokens" in res["error"], err
