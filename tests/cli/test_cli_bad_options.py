"""``spec-grammar generate`` with nonsense worker and sampling flags: one line naming the flag
(exit 2) before the model loads; a batch line with a nonsense sampling value fails alone and
the other lines complete."""

from __future__ import annotations

import json

import pytest

from spec_grammar.cli import main
from spec_grammar.worker import api
from spec_grammar.worker.config import WorkerConfig
from spec_grammar.worker.sampling import SamplingParams


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the argument error was reported")

    monkeypatch.setattr(api, "_load", refuse)


def one_error_line(capsys, rc: int, *needles: str) -> None:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("spec-grammar generate: error: "), err
    for n in needles:
        assert n in lines[0], err


@pytest.mark.parametrize(
    "flags, needles",
    [
        # were pydantic's three-line ValidationError (--topk 0 was accepted for ngram drafts)
        (["--topk", "0"], ["--topk", "greater than or equal to 1", "got 0"]),
        (["--num-steps", "-1"], ["--num-steps", "got -1"]),
        (["--num-draft-tokens", "0"], ["--num-draft-tokens", "got 0"]),
        # were reported only after the model had loaded
        (["--draft", "bogus"], ["unknown drafter 'bogus'"]),
        (["--draft", "self:x"], ["self:L needs an integer layer count, got 'x'"]),
        (["--draft", "model:"], ["unknown drafter 'model:'"]),
        # were accepted: each request failed with "the processed row of node 0 allows no token
        # ... (was the grammar already terminated at the root?)", or the whole run with
        # "Overflow when unpacking long long"
        (["--temperature", "inf"], ["--temperature", "finite"]),
        (["--frequency-penalty", "nan"], ["--frequency-penalty", "finite"]),
        (["--presence-penalty", "inf"], ["--presence-penalty", "finite"]),
        (["--repetition-penalty", "inf"], ["--repetition-penalty", "finite"]),
        (["--seed", str(2**64)], ["--seed", "less than or equal to 18446744073709551615"]),
        (["--seed", str(-(2**63) - 1)], ["--seed", "greater than or equal to"]),
    ],
)
def test_bad_flags_are_one_line_before_the_model(capsys, no_model_load, flags, needles):
    rc = main(["generate", *flags, "--max-new-tokens", "1", "hi"])
    one_error_line(capsys, rc, *needles)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("temperature", float("nan"), "finite"),
        ("temperature", float("inf"), "finite"),
        ("top_p", float("nan"), "finite"),
        ("repetition_penalty", float("inf"), "finite"),
        ("frequency_penalty", float("-inf"), "finite"),
        ("presence_penalty", float("nan"), "finite"),
        ("logit_bias", {1: float("nan")}, "logit_bias[1] must be a finite number or -inf"),
        ("logit_bias", {1: float("inf")}, "logit_bias[1] must be a finite number or -inf"),
        ("seed", 2**64, "less than or equal to"),
        ("seed", 2**70, "less than or equal to"),
    ],
)
def test_sampling_values_are_finite_and_seeds_fit_a_generator(field, value, needle):
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=field) as e:
        SamplingParams(**{field: value})
    assert needle in str(e.value)


def test_sampling_edge_values_that_mean_something_pass():
    import torch

    from spec_grammar.worker.sampling import make_generator

    assert SamplingParams(logit_bias={1: float("-inf")}).logit_bias == {1: float("-inf")}
    for seed in (-(2**63), 2**64 - 1, 0, -1):
        make_generator(SamplingParams(seed=seed))  # what torch's manual_seed takes
    assert torch.Generator().manual_seed(2**64 - 1) is not None


@pytest.mark.model
def test_a_batch_line_with_a_nonsense_value_fails_alone(capsys, tmp_path):
    """Line 2's seed made ``torch.Generator.manual_seed`` raise in the middle of the run: no
    line got a result and the CLI exited 2. Lines 3-4 (an infinite temperature, parsed from
    JSON's 1e999, and a NaN penalty) each failed with a misleading "was the grammar already
    terminated at the root?"."""
    f = tmp_path / "b.jsonl"
    good = {"prompt": "Give a number", "regex": "[0-9]+"}
    f.write_text(
        "\n".join(
            [
                json.dumps(good),
                json.dumps({**good, "seed": 2**70}),
                json.dumps(good)[:-1] + ', "temperature": 1e999}',
                json.dumps(good)[:-1] + ', "frequency_penalty": NaN}',
                json.dumps(good),
            ]
        )
    )
    rc = main(["generate", "--batch-file", str(f), "--max-new-tokens", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 1
    res = {r["rid"]: r for r in json.loads(out)["results"]}
    assert res["line-2"]["error"].startswith(f"{f}:2: field 'seed': ")
    assert res["line-3"]["error"].startswith(f"{f}:3: field 'temperature': ")
    assert res["line-4"]["error"].startswith(f"{f}:4: field 'frequency_penalty': ")
    for rid in ("line-1", "line-5"):
        assert res[rid]["finish_reason"] != "error" and res[rid]["token_ids"], res[rid]
    assert res["line-1"]["token_ids"] == res["line-5"]["token_ids"]


class _EchoWorker:
    """Stands in for the worker (no model): each request comes back with its prompt's length."""

    def __init__(self):
        import types

        from spec_grammar.models import load_tokenizer

        self.tokenizer = load_tokenizer("smollm2")
        self.step_stats = []
        self.runner = types.SimpleNamespace(
            device="cpu", uses_fused_forward=False, uses_cuda_graphs=False
        )
        self.config = WorkerConfig()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def run(self, reqs, on_step=None):
        from spec_grammar.worker.request import RequestResult

        return [
            RequestResult(
                rid=r.rid,
                text=self.tokenizer.decode(r.prompt),
                token_ids=[],
                prompt_tokens=len(r.prompt),
                finish_reason="length",
                finish_detail="length",
                error=None,
                num_tokens=0,
                steps=0,
                accept_length=0.0,
                tokens_per_s=0.0,
                grammar_ms_hidden=0.0,
                grammar_ms_exposed=0.0,
            )
            for r in reqs
        ]


def test_batch_lines_are_split_at_newlines_only(capsys, monkeypatch, tmp_path):
    """A prompt holding U+2028 or U+0085 raw (valid JSON; ``json.dumps(ensure_ascii=False)``
    writes them so) was cut in two by ``str.splitlines``: that request failed as "not valid
    JSON" and every later line got the wrong id. A leading UTF-8 BOM failed line 1; CRLF
    endings are fine."""
    monkeypatch.setattr(api, "build_worker", lambda **k: _EchoWorker())
    prompts = ["first", "a\u2028b", "c\u0085d", "e\u2029f\x1cg", "last"]
    lines = [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
    f = tmp_path / "b.jsonl"
    f.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8"))
    rc = main(["generate", "--batch-file", str(f), "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out)["results"]
    assert [r["rid"] for r in res] == [f"line-{n}" for n in range(1, 6)]
    for r, p in zip(res, prompts):
        assert r["error"] is None and p in r["text"], r


@pytest.mark.parametrize("flag", ["--batch-file", "--json-schema", "--ebnf"])
def test_a_file_that_is_not_text_is_named(capsys, no_model_load, tmp_path, flag):
    """Was "'utf-8' codec can't decode byte 0x89 in position 0: invalid start byte", naming
    neither the file nor the flag."""
    f = tmp_path / "image.png"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    rc = main(["generate", flag, str(f), *([] if flag == "--batch-file" else ["hi"])])
    one_error_line(capsys, rc, f"file {f} is not UTF-8 text")
