"""Faults inside the speculative worker, on the real SmolLM2 (float64, so argmax near-ties
cannot flip between batch shapes) with fault-injecting subclasses of the real xgrammar backend.

A fault (an exception in a grammar fill or accept, a compile that never finishes, a request
cancelled mid-step) ends the affected request with its error; every other request of the batch
produces exactly the tokens of a run without the faulty request (their KV cache and matcher
state were untouched). Plus the CLI: one clear line and a non-zero exit for bad input, and a
``--batch-file`` whose bad lines are marked while the others complete.
"""

from __future__ import annotations

import json

import pytest
from faults import (
    ACCEPT_FAULT,
    BLOCKED,
    FILL_FAULT,
    GOOD,
    MAX_NEW,
    STATE_FAULT,
    FaultyBackend,
    good_requests,
    make_worker,
    model_and_tokenizer,
    reference,
    request,
)

from spec_grammar.cli import main as cli_main
from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.drafters import NgramDrafter
from spec_grammar.worker.runner import RunnerError
from spec_grammar.worker.sampling import SamplingParams

pytestmark = pytest.mark.model


@pytest.mark.parametrize("overlap", [True, False])
def test_faults_end_only_their_request(overlap):
    """One batch: the good requests plus one request per fault. The faulty ones end with their
    error; the good ones give exactly the tokens of a run without the faulty ones."""
    reqs = good_requests()
    reqs.insert(0, request("Pick a direction:", BLOCKED, "blocked"))
    # long budgets: the faults must strike while the request still runs
    reqs.insert(2, request("the sea is", FILL_FAULT, "fill-fault", max_new_tokens=64))
    reqs.insert(3, request("A cat", ACCEPT_FAULT, "accept-fault", max_new_tokens=64))
    reqs.insert(4, request("Count:", STATE_FAULT, "state-fault", max_new_tokens=64))
    reqs.append(
        request(
            "Once there was a dragon who", None, "cancelled", max_new_tokens=64, ignore_eos=True
        )
    )
    w = make_worker(overlap)
    fills = []

    def cancel_in_third_fill() -> (
        None
    ):  # runs inside the step (under the verify forward with overlap)
        fills.append(1)
        if len(fills) == 3:
            w.cancel("cancelled")

    w.backend.on_fill = cancel_in_third_fill
    try:
        results = w.run(reqs)
        with pytest.raises(KeyError, match="no running request 'cancelled'"):
            w.cancel("cancelled")
    finally:
        w.backend.release.set()
        w.close()
    by = {r.rid: r for r in results}

    r = by["blocked"]
    assert (r.finish_reason, r.token_ids) == ("error", [])
    assert r.error == "[xgrammar] regex compile did not finish within compile_timeout_s=0.5"
    r = by["fill-fault"]
    assert r.finish_reason == "error" and r.steps == 2
    assert (
        r.error
        == "the grammar failed while filling the tree bitmask: RuntimeError: injected fault in fill_tree_bitmask"
    )
    r = by["accept-fault"]
    assert r.finish_reason == "error"
    assert (
        r.error
        == "the grammar failed while accepting committed tokens: RuntimeError: injected fault in accept_token"
    )
    r = by["state-fault"]
    assert (r.finish_reason, r.token_ids) == ("error", [])
    assert (
        r.error
        == "the grammar failed while checking its state: RuntimeError: injected fault in is_terminated"
    )
    r = by["cancelled"]
    assert (r.finish_reason, r.error, r.steps) == ("cancelled", "cancelled by the caller", 3)
    assert 0 < r.num_tokens < 64

    ref = reference()
    assert {rid: (by[rid].token_ids, by[rid].finish_reason) for rid in ref} == ref
    assert all(by[rid].error is None for rid in ref)
    assert not w.runner.request_ids  # every KV slot was freed


class RefusingDrafter(NgramDrafter):
    """The n-gram drafter, refusing to start request ``rid`` (as a draft model whose vocabulary
    lacks one of its prompt ids would)."""

    def __init__(self, rid: str):
        super().__init__(num_draft_tokens=6)
        self.rid = rid

    def add(self, state) -> None:
        if state.rid == self.rid:
            raise RunnerError(f"request {state.rid!r}: token ids outside the draft vocabulary")


def test_prompts_refused_at_prefill_end_only_their_request():
    """The requests are prefilled together: a prompt the runner refuses (a token id outside the
    vocabulary) or the drafter refuses ends that request; the others give the tokens they give
    alone, and no KV slot is left behind."""
    model, tok = model_and_tokenizer()
    backend = FaultyBackend(tok, vocab_size=model.config.vocab_size)
    reqs = good_requests()
    reqs.insert(
        1,
        Request(
            [504, model.config.vocab_size + 7, 282],
            GOOD[0][1],
            SamplingParams(max_new_tokens=MAX_NEW),
            rid="oov",
        ),
    )
    reqs.insert(3, request("Say hi:", None, "drafter-refused"))
    with SpecWorker(model, tok, backend=backend, draft=RefusingDrafter("drafter-refused")) as w:
        results = w.run(reqs)
        assert not w.runner.request_ids
    by = {r.rid: r for r in results}
    assert by["oov"].finish_reason == "error" and "outside [0, 49152)" in by["oov"].error
    assert by["drafter-refused"].finish_reason == "error"
    assert by["drafter-refused"].error.startswith("the drafter refused the request: ")
    assert {rid: (by[rid].token_ids, by[rid].finish_reason) for rid in reference()} == reference()


# -- the CLI ---------------------------------------------------------------------------------
def run_cli(capsys, *argv):
    code = cli_main(["generate", "--max-new-tokens", "6", "--draft", "none", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_bad_input_is_one_line(capsys, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"type": "object",')
    bad_schema = tmp_path / "schema.json"
    bad_schema.write_text('{"type": "strnig"}')
    cases = [
        (
            ["--grammar-backend", "nope", "hi"],
            2,
            "spec-grammar generate: error: unknown grammar backend 'nope'; registered: ",
        ),
        (
            ["--json-schema", str(tmp_path / "missing.json"), "hi"],
            2,
            "spec-grammar generate: error: JSON schema file not found: ",
        ),
        (
            ["--json-schema", str(bad_json), "hi"],
            2,
            f"spec-grammar generate: error: JSON schema file {bad_json} is not valid JSON: ",
        ),
        # the CLI grammar compiles before the model loads: a bad one is a bad argument
        (
            ["--json-schema", str(bad_schema), "hi"],
            2,
            "spec-grammar generate: error: [auto] invalid JSON Schema at type: 'strnig' is not valid",
        ),
        (
            ["--regex", "(unclosed", "hi"],
            2,
            "spec-grammar generate: error: [xgrammar] regex failed to compile: ",
        ),
    ]
    for argv, code, line in cases:
        got, out, err = run_cli(capsys, *argv)
        lines = [x for x in err.splitlines() if x.startswith(("error:", "spec-grammar"))]
        assert got == code and len(lines) == 1 and lines[0].startswith(line), (argv, got, err)


def test_cli_batch_file_marks_failed_lines(capsys, tmp_path):
    lines = [
        {"prompt": "Say yes or no.", "regex": "(yes|no)"},
        "this line is not JSON",
        {
            "prompt": "An object.",
            "json_schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
        },
        {"prompt": "Count to three.", "regex": "(one|two|three)( (one|two|three))*"},
        {"prompt": "Bad regex.", "regex": "[z-a]"},
        {"no_prompt": True},
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    code, out, _ = run_cli(capsys, "--batch-file", str(batch), "--json")
    results = json.loads(out)["results"]
    assert code == 1 and len(results) == 6
    reasons = [r["finish_reason"] for r in results]
    assert [x == "error" for x in reasons] == [False, True, True, False, True, True]
    assert results[1]["error"].startswith(f"{batch}:2: ")
    assert "invalid JSON Schema at properties/a/type" in results[2]["error"]
    assert results[4]["error"].startswith(f"{batch}:5: [xgrammar] regex failed to compile")
    assert (
        results[5]["error"]
        == f"{batch}:6: each line needs a string field 'prompt' or a 'messages' list"
    )
    assert results[0]["text"] in ("yes", "no") or results[0]["finish_reason"] == "length"
