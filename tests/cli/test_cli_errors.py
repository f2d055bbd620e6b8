"""Bad input to ``spec-grammar generate`` and to the worker API: one clear line (exit 2) before
the model loads when the CLI arguments are wrong, and a typed per-request error (the batch
goes on) when one request or batch line is wrong.

Tests that end before the model loads run in milliseconds; the others run the real SmolLM2
with ``max_new_tokens`` <= 4.
"""

from __future__ import annotations

import json

import pytest
import torch

from spec_grammar.cli import main
from spec_grammar.specs import JsonSchema, Regex
from spec_grammar.worker import api
from spec_grammar.worker.request import Request, RequestError, check_request
from spec_grammar.worker.sampling import SamplingParams


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI gets as far as loading the model weights."""

    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the argument error was reported")

    monkeypatch.setattr(api, "_load", refuse)


def one_error_line(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("spec-grammar generate: error: "), err
    for n in needles:
        assert n in lines[0], err


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--max-new-tokens", "-3"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
    ],
)
def test_bad_sampling_flags_fail_before_the_model(capsys, no_model_load, flags, flag):
    rc, _, err = cli(capsys, *flags, "--regex", "a+", "hi")
    assert rc == 2
    one_error_line(err, flag)


@pytest.mark.parametrize("content", ["", "\n  \n\t\n"])
def test_empty_batch_file_fails_early(capsys, no_model_load, tmp_path, content):
    f = tmp_path / "b.jsonl"
    f.write_text(content)
    rc, _, err = cli(capsys, "--batch-file", str(f))
    assert rc == 2
    one_error_line(err, f"batch file {f} has no requests")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(capsys, no_model_load):
    rc, _, err = cli(capsys, "--device", "cuda", "--regex", "a+", "hi")
    assert rc == 2
    one_error_line(err, "CUDA is not available")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--regex", "(a"], "parenthesis is not closed"),
        (["--json-schema", "SCHEMA"], "strnig"),
        (["--grammar-backend", "outlines", "--ebnf", "EBNF"], "ebnf grammars are not supported"),
    ],
)
def test_cli_grammar_compiles_before_the_model(capsys, no_model_load, tmp_path, flags, needle):
    (tmp_path / "s.json").write_text('{"type": "strnig"}')
    (tmp_path / "g.ebnf").write_text('root ::= "yes" | "no"\n')
    flags = [
        {"SCHEMA": str(tmp_path / "s.json"), "EBNF": str(tmp_path / "g.ebnf")}.get(a, a)
        for a in flags
    ]
    rc, _, err = cli(capsys, *flags, "hi")
    assert rc == 2
    one_error_line(err, needle)
    assert "/project/cpp" not in err  # xgrammar's source-location prefix is stripped


def test_schema_file_holding_a_json_string(capsys, no_model_load, tmp_path):
    f = tmp_path / "s.json"
    f.write_text('"x"')
    rc, _, err = cli(capsys, "--json-schema", str(f), "hi")
    assert rc == 2
    one_error_line(err, "must be an object or boolean", "a string")


@pytest.mark.parametrize("flag", ["--json-schema", "--batch-file"])
def test_directory_instead_of_file(capsys, no_model_load, tmp_path, flag):
    rc, _, err = cli(capsys, flag, str(tmp_path), *(["hi"] if flag != "--batch-file" else []))
    assert rc == 2
    one_error_line(err, "is a directory")


def test_unknown_drafter_lists_grammar(capsys):
    rc, _, err = cli(capsys, "--draft", "nonsense", "--max-new-tokens", "1", "hi")
    assert rc == 2
    assert (
        err.rstrip().splitlines()[-1].endswith("use ngram, self:L, model:PATH, grammar or none")
    ), err


def test_request_fields_are_checked():
    with pytest.raises(RequestError, match="grammar must be a spec"):
        check_request(Request(prompt="x", grammar="not a spec"))
    with pytest.raises(RequestError, match="temperature"):
        check_request(Request(prompt="x", sampling={"temperature": -1}))
    assert check_request(Request(prompt="x", sampling={"temperature": 0.5})) == SamplingParams(
        temperature=0.5
    )


@pytest.mark.model  # runs the real SmolLM2
def test_bad_batch_lines_fail_alone_with_line_ids(capsys, tmp_path):
    f = tmp_path / "b.jsonl"
    lines = [
        {"prompt": "Give a number", "regex": "[0-9]+"},
        {"prompt": "x", "regex": "[0-9]+", "temperature": "hot"},
        {"prompt": "x", "regex": "[0-9]+", "max_new_tokens": -5},
        {"prompt": "Give a list", "json_schema": {"type": "array", "uniqueItems": True}},
        {
            "prompt": "json",
            "schema": {"type": "object"},
            "max_tokens": 3,
            "temprature": 2,
        },  # misspelt keys
        {
            "prompt": "x",
            "ebnf": "missing.gbnf",
        },  # a grammar file that is not there, not grammar text
    ]
    f.write_text(
        "\n".join(json.dumps(x) for x in lines[:2])
        + "\n\n"
        + "\n".join(json.dumps(x) for x in lines[2:])
    )
    rc, out, err = cli(capsys, "--batch-file", str(f), "--max-new-tokens", "3", "--json")
    assert rc == 1
    res = {r["rid"]: r for r in json.loads(out)["results"]}
    assert list(res) == [
        "line-1",
        "line-2",
        "line-4",
        "line-5",
        "line-6",
        "line-7",
    ]  # line 3 is blank
    assert (
        res["line-7"]["error"] == f"{f}:7: EBNF grammar file {tmp_path / 'missing.gbnf'} not found"
    )
    assert res["line-1"]["finish_reason"] != "error" and res["line-1"]["text"]
    assert res["line-2"]["error"].startswith(f"{f}:2: field 'temperature': ")
    assert res["line-4"]["error"].startswith(f"{f}:4: field 'max_new_tokens': ")
    assert "\n" not in res["line-2"]["error"] + res["line-4"]["error"]
    assert res["line-5"]["finish_reason"] != "error"
    assert any("uniqueItems" in w for w in res["line-5"]["warnings"])
    bad_keys = res["line-6"]["error"]
    assert bad_keys.startswith(
        f"{f}:6: unknown fields 'schema', 'max_tokens', 'temprature'; accepted: prompt, messages, "
        "json_schema"
    )
    assert "max_new_tokens" in bad_keys and "temperature" in bad_keys and "\n" not in bad_keys
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert len(warn) == 1 and "line-5" in warn[0] and "uniqueItems" in warn[0]


@pytest.mark.model  # runs the real SmolLM2
def test_bad_requests_fail_alone_in_the_api():
    """Wrong-typed grammar / sampling and out-of-vocabulary prompt ids: a typed error for
    that request; the good request completes and a dict ``sampling`` is accepted."""
    sp = SamplingParams(max_new_tokens=2)
    good = Request(
        prompt="<|im_start|>user\nA number<|im_end|>\n<|im_start|>assistant\n",
        grammar=Regex("[0-9]+"),
        sampling=sp,
    )
    reqs = [
        good,
        Request(prompt="x", grammar="not a spec", sampling=sp),
        Request(
            prompt="x", grammar=Regex("[0-9]+"), sampling={"temperature": 5, "max_new_tokens": 2}
        ),
        Request(prompt="x", sampling={"temperature": "hot"}),
        Request(prompt=[10**9], grammar=Regex("[0-9]+"), sampling=sp),
        Request(prompt=[-1, 5], sampling=sp),
    ]
    out = api.generate(reqs, max_new_tokens=2)
    assert [r.rid for r in out] == [r.rid for r in reqs]
    assert out[0].finish_reason != "error" and out[0].text.isdigit()
    assert "grammar must be a spec" in out[1].error
    assert out[2].finish_reason != "error" and out[2].num_tokens <= 2  # dict sampling converted
    assert "temperature" in out[3].error
    assert "outside [0," in out[4].error and "1000000000" in out[4].error
    assert "outside [0," in out[5].error


@pytest.mark.model  # runs the real SmolLM2
def test_precompile_is_reused_by_the_worker():
    spec = JsonSchema(
        {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
            "title": "precompile-test",
        }
    )
    compiled = api.precompile(spec)
    worker = api.build_worker(draft=None)
    before = worker.backend.num_compiles
    assert worker.backend.compile(spec) is compiled
    assert worker.backend.num_compiles == before


@pytest.mark.parametrize("module, extra", [("rich", "cli"), ("matplotlib.pyplot", "bench")])
def test_missing_extra_names_the_install_command(capsys, monkeypatch, module, extra):
    """Without the extra a subcommand needs (the base install has no rich, transformers, ...),
    one line says which extra to install; other missing modules still raise."""
    from spec_grammar.cli import backends

    def missing(_args):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(backends, "run", missing)
    assert main(["backends"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spec-grammar backends: error: No module named")
    assert err.endswith(f"install it with: pip install 'spec-grammar[{extra}]'")

    def other(_args):
        raise ModuleNotFoundError("No module named 'nope'", name="nope")

    monkeypatch.setattr(backends, "run", other)
    with pytest.raises(ModuleNotFoundError):
        main(["backends"])


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines"])
def test_backend_without_its_library_names_its_extra(capsys, monkeypatch, name):
    """A built-in backend whose library is not importable (``sys.modules[lib] = None`` makes
    the real import fail) is listed with one install command, its extra, in the table and in
    ``get_backend``'s error (the table's markup once swallowed ``[xgrammar]``)."""
    import sys

    from spec_grammar import BackendNotFoundError, get_backend
    from spec_grammar.models import load_tokenizer

    library = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines": "outlines_core"}
    monkeypatch.setitem(sys.modules, library[name], None)
    monkeypatch.delitem(sys.modules, f"spec_grammar_{name}", raising=False)
    monkeypatch.setenv("COLUMNS", "400")
    hint = f"install it with: pip install 'spec-grammar[{name}]'"
    with pytest.raises(
        BackendNotFoundError, match="registered but its library is not installed"
    ) as e:
        get_backend(name, load_tokenizer("smollm2"))
    assert str(e.value).endswith(hint) and "pip install" not in str(e.value)[: -len(hint)]
    assert main(["backends", "--check"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if f" {name} " in line)
    assert hint in row


def test_model_loader_without_the_worker_extra_names_it(capsys, monkeypatch):
    """Without transformers (blocked in ``sys.modules``), the model loader names the extra that
    brings it, and ``generate`` prints one line with one install command."""
    import sys

    from spec_grammar.models import load_tokenizer

    monkeypatch.setitem(sys.modules, "transformers", None)
    # as in a fresh process: no tokenizer or model an earlier test left in the API's caches
    monkeypatch.setattr(api, "_tokenizers", {})
    monkeypatch.setattr(api, "_models", {})
    with pytest.raises(ModuleNotFoundError, match=r"spec-grammar\[worker\]") as e:
        load_tokenizer("smollm2")
    assert e.value.name == "transformers"
    code = main(["generate", "--grammar-backend", "llguidance", "--regex", "[a-z]+", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].count("pip install") == 1
    assert err[0].endswith("install it with: pip install 'spec-grammar[cli]'")
