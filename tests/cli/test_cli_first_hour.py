"""What a new user meets first in ``spec-grammar generate``: a fast ``--help`` (no torch
import), flags named like SGLang's, a grouped help with every default, inline JSON schemas, the
CPU thread policy, and a cut output that exits 3 naming the request (issue 24).

Tests without the ``model`` marker end before the model loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from spec_grammar.cli import build_parser, main
from spec_grammar.cli.generate import CUT_EXIT_CODE, _cli_spec, _worker_config
from spec_grammar.specs import JsonSchema
from spec_grammar.worker.defaults import DEFAULT_CPU_THREADS, DEFAULT_FORCED_TOKENS, cpu_threads

ROOT = Path(__file__).resolve().parents[2]
PERSON = ROOT / "examples" / "schemas" / "person.json"


def _python(code: str, **env: str | None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter on this checkout; ``env`` values of None unset."""
    paths = [str(ROOT), str(ROOT / "adapters"), str(ROOT / "benchmarks")]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **env}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_help_and_argument_errors_import_no_torch():
    """``--help`` took ~3-8 s: the package imported torch, pydantic and the worker first."""
    code = (
        "import sys\nfrom spec_grammar.cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['generate', '--bogus']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'pydantic', 'xgrammar') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
        "rc = main(['generate', '--temperature', '-1', '--regex', 'a', 'hi'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules]\n"
        "print('SAMPLING', rc, heavy)\n"
    )
    out = _python(code)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    assert "unrecognized arguments: --bogus" in out.stderr
    # a bad sampling flag is reported before torch and the grammar library load (was 23-35 s)
    assert "SAMPLING 2 []" in out.stdout and "--temperature" in out.stderr, out.stdout


def _parse(*argv: str):
    return build_parser().parse_args(["generate", *argv])


@pytest.mark.parametrize(
    "long, short, dest, value",
    [
        ("--speculative-algorithm", "--draft", "draft", "self:2"),
        ("--speculative-num-steps", "--num-steps", "num_steps", 3),
        ("--speculative-eagle-topk", "--topk", "topk", 2),
        ("--speculative-num-draft-tokens", "--num-draft-tokens", "num_draft_tokens", 5),
    ],
)
def test_speculative_flags_take_sglang_names_and_keep_the_short_ones(long, short, dest, value):
    a, b = _parse(long, str(value), "hi"), _parse(short, str(value), "hi")
    assert getattr(a, dest) == getattr(b, dest) == value
    assert getattr(_worker_config(a), dest) == value  # reaches the worker's config


def test_help_is_grouped_and_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for title in ("grammar (", "speculation (", "sampling:", "performance (advanced):"):
        assert title in text, title
    parser = build_parser()
    gen = parser._subparsers._group_actions[0].choices["generate"]
    flat = " ".join(text.split())
    for action in gen._actions:
        if action.default in (None, "==SUPPRESS==") or not action.option_strings:
            continue
        shown = f"(default: {action.default})"
        assert shown in flat or f"default: {action.default}" in flat, action.option_strings
    on = "on" if DEFAULT_FORCED_TOKENS else "off"
    assert "--no-forced-tokens extend drafts with grammar-forced tokens (default: " + on in flat
    assert f"else {DEFAULT_CPU_THREADS})" in flat


def test_json_schema_takes_a_file_or_inline_json():
    inline = _parse("--json-schema", PERSON.read_text(), "hi")
    from_file = _parse("--json-schema", str(PERSON), "hi")
    assert _cli_spec(inline) == _cli_spec(from_file) == JsonSchema(json.loads(PERSON.read_text()))


def test_bad_inline_json_names_the_flag(capsys):
    rc = main(["generate", "--json-schema", '{"type": ', "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "--json-schema: inline JSON is not valid" in err, err


def test_thread_policy_flag_then_env_then_default(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads() == DEFAULT_CPU_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads() == 2 and cpu_threads(3) == 3


@pytest.mark.integration  # a fresh interpreter per case
@pytest.mark.parametrize("env, want", [(None, DEFAULT_CPU_THREADS), ("2", 2)])
def test_thread_policy_reaches_torch_in_a_fresh_process(env, want):
    """The policy is set before torch loads: torch's own count is the oracle."""
    code = (
        "from spec_grammar.worker.defaults import apply_cpu_threads\n"
        "n = apply_cpu_threads(None)\nimport torch\nprint('THREADS', n, torch.get_num_threads())\n"
    )
    out = _python(code, OMP_NUM_THREADS=env)
    assert f"THREADS {want} {want}" in out.stdout, out.stdout + out.stderr


@pytest.mark.model
def test_a_cut_grammar_output_exits_3_naming_the_request(capsys, tmp_path):
    """An output cut at max_new_tokens exited 0 with a note: it does not parse. Line 1 is cut
    (4 tokens of a person object); line 2 (OpenAI-style messages) completes its regex; line 3
    is cut inside a regex any prefix of which is a match, and the note says it is valid as it
    stands (it said "incomplete" for every cut output)."""
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        json.dumps({"prompt": "Invent a person.", "json_schema": str(PERSON), "max_new_tokens": 4})
        + "\n"
        + json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Answer yes or no."},
                    {"role": "user", "content": "Is water wet?"},
                ],
                "regex": "(yes|no)",
                "max_new_tokens": 8,
            }
        )
        + "\n"
        + json.dumps({"prompt": "Say hello.", "regex": "[a-z ]+", "max_new_tokens": 6})
        + "\n"
    )
    rc = main(["generate", "--batch-file", str(batch), "--json"])
    out, err = capsys.readouterr()
    res = {r["rid"]: r for r in json.loads(out)["results"]}
    assert rc == CUT_EXIT_CODE, err
    assert res["line-1"]["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):  # the oracle: the cut text is no document
        json.loads(res["line-1"]["text"])
    assert res["line-2"]["finish_reason"] == "stop" and res["line-2"]["finish_detail"] == "grammar"
    assert res["line-2"]["text"] in ("yes", "no")
    cut_lines = [ln for ln in err.splitlines() if "cut at --max-new-tokens" in ln]
    assert len(cut_lines) == 2 and "line-1" in cut_lines[0] and "line-3" in cut_lines[1], err
    assert "incomplete" in cut_lines[0]
    assert re.fullmatch("[a-z ]+", res["line-3"]["text"])  # the oracle: a whole match
    assert "valid as it stands" in cut_lines[1] and res["line-3"]["valid"] is None


@pytest.mark.model
def test_streamed_stdout_is_the_output_and_inline_schema_validates(capsys):
    schema = json.loads(PERSON.read_text())
    rc = main(
        ["generate", "--json-schema", json.dumps(schema), "--system", "You are terse.",
         "--max-new-tokens", "200", "Invent a software engineer."]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    jsonschema.validate(json.loads(out), schema)
    assert "forced tokens on" in err.splitlines()[-1] or not DEFAULT_FORCED_TOKENS


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--tools", '[{"type": "function", "function": {"name": "f"}}]', "--tool-choice", "g"],
            "not in tools",
        ),
        (["--regex", "a", "--max-reasoning-tokens", "3"], "needs --reasoning-end"),
    ],
)
def test_tool_choice_and_reasoning_flags_fail_before_the_model_loads(argv, needle, capsys):
    from spec_grammar.cli import main

    assert main(["generate", *argv, "hi"]) == 2
    assert needle in capsys.readouterr().err


def test_batch_lines_take_tool_choice_and_reasoning_fields():
    from spec_grammar.cli.generate import _check_line_keys

    _check_line_keys(
        {
            "prompt": "x",
            "tools": [],
            "tool_choice": "auto",
            "reasoning_end": "</think>",
            "max_reasoning_tokens": 4,
        }
    )
