"""The grammar-aware drafter (``GrammarNgramProposer``, vLLM's ``custom_class`` speculation)
end to end on the real vLLM (CPU build 0.32) with SmolLM2, per backend (xgrammar, llguidance,
outlines-core): one batch of structured requests plus one without a constraint, greedy, with
the drafter and without speculation. Oracles: the non-speculative run's token ids (drafts never change greedy
outputs), jsonschema / ``re.fullmatch`` on the outputs, vLLM's own speculative-decoding counters
(drafts were accepted). Six engine starts; ``scripts/test_vllm.sh`` runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
jsonschema = pytest.importorskip("jsonschema")

from test_vllm import PERSON, RUNNER, TAGS, TOOL_TAG, check_tool_call, vllm_env  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.model]

DRAFTER = {
    "method": "custom_class",
    "model": "spec_grammar.integrations.vllm.drafter.GrammarNgramProposer",
    "num_speculative_tokens": 4,
}
REQUESTS = [
    (
        {
            "prompt": 'Repeat this JSON exactly: {"name": "Ada Lovelace", "age": 36, "city": "London"}',
            "max_tokens": 80,
            "structured": {"json": PERSON},
        },
        lambda text: jsonschema.validate(json.loads(text), PERSON),
    ),
    (
        {
            "prompt": "Give three short tags for a blog post about sourdough bread, as JSON.",
            "max_tokens": 80,
            "structured": {"json": TAGS},
        },
        lambda text: jsonschema.validate(json.loads(text), TAGS),
    ),
    (
        {
            "prompt": "My phone number is 555-1234. Repeat my phone number.",
            "max_tokens": 20,
            "structured": {"regex": r"[0-9]{3}-[0-9]{4}"},
        },
        lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) or pytest.fail(repr(text)),
    ),
    (
        {
            "prompt": "Is the sky blue? Answer yes, no or maybe.",
            "max_tokens": 10,
            "structured": {"choice": ["yes", "no", "maybe"]},
        },
        lambda text: text in ("yes", "no", "maybe") or pytest.fail(repr(text)),
    ),
    (
        {
            "prompt": "Call the add tool for 2 plus 3, in <tool_call> tags.",
            "max_tokens": 60,
            "structured": {"structural_tag": json.dumps(TOOL_TAG)},
        },
        check_tool_call,
    ),
    # no constraint: plain n-gram drafts from the same proposer
    ({"prompt": "Say hello to Ada in one sentence.", "max_tokens": 24}, None),
]


def run(model_dir: str, backend: str, speculative: dict | None) -> dict:
    job = {
        "model": model_dir,
        "structured_backend": "guidance",
        "speculative": speculative,
        "requests": [r for r, _ in REQUESTS],
    }
    proc = subprocess.run(
        [sys.executable, str(RUNNER), json.dumps(job)],
        env=vllm_env(backend),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_grammar_drafter_gives_the_plain_greedy_tokens(model_dir, backend):
    plain = run(model_dir, backend, None)
    spec = run(model_dir, backend, DRAFTER)
    for (request, check), a, b in zip(REQUESTS, plain["outputs"], spec["outputs"]):
        assert b["token_ids"] == a["token_ids"], request["prompt"]
        assert b["finish_reason"] == a["finish_reason"], request["prompt"]
        if check is not None:
            assert b["finish_reason"] == "stop", (request["prompt"], b)
            check(b["text"])
    assert spec["spec"]["num_drafts"] > 0 and spec["spec"]["num_accepted_tokens"] > 0, spec["spec"]
    # the proposer found the model runner and fell back for no request
    assert "no vLLM model runner found" not in spec["log"]
    assert "falls back to plain n-gram" not in spec["log"]
