"""The speculative worker end to end on the real SmolLM2 (float64, so near-tie argmax flips
between batch shapes cannot happen) with every installed grammar backend.

Oracles: plain constrained decoding (``no_spec``) through the same worker, ``jsonschema``
(Draft 2020-12) and ``re.fullmatch`` on finished outputs, fresh-matcher replay of every output.
One worker run holds a whole mixed batch (real JSONSchemaBench schemas, regexes, EBNF, a plain
prompt, two grammars that fail to compile) to stay inside the CI budget.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import jsonschema
import pytest
from emulated_graphs import make_runner
from real_model import JSON_BACKENDS, backend, model_and_tokenizer, replays

from spec_grammar import Ebnf, JsonSchema, Regex
from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.tree import DraftTree
from spec_grammar.worker import Request, SpecWorker, build_prompt
from spec_grammar.worker.decoder import cpu_attention, cpu_gemm
from spec_grammar.worker.defaults import DEFAULT_FORCED_TOKENS
from spec_grammar.worker.drafters import Drafter
from spec_grammar.worker.sampling import SamplingParams

pytestmark = pytest.mark.model

MAX_NEW = 20
BACKENDS = JSON_BACKENDS
# 20 of the smallest sample schemas (o6167 left out: an 11 s outlines-core index build).
SCHEMA_IDS = [
    "o27841",
    "o27834",
    "o89088",
    "o79447",
    "o12240",
    "wp_69_Normalized",
    "wp_36_Normalized",
    "o56137",
    "o25983",
    "o17626",
    "wp_88_Normalized",
    "o13683",
    "wp_52_Normalized",
    "o17637",
    "o12214",
    "o31092",
    "o83692",
    "o60145",
    "o68625",
]
REGEXES = [
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,10}",
    r"\d{3}-\d{3}-\d{4}",
]
EBNF = [
    'root ::= "The answer is " num "."\nnum ::= [0-9]+',
    'root ::= item (", " item)*\nitem ::= "red" | "green" | "blue"',
]
# short outputs make grammar completions (the validated ones) frequent inside MAX_NEW tokens
JSON_PROMPT = (
    "Reply with a minimal JSON document: use empty strings, 0 and empty lists where you can."
)
BAD = [JsonSchema({"type": "object", "properties": {"a": {"type": "strin"}}}), Regex("([a-z]")]

# config name -> (SpecWorker options, run on the small sub-batch); chain and tree drafts, topk 1
# and 3, overlap on and off. Model drafters cost a draft forward per depth: they verify on the
# sub-batch (8 schemas + every regex/EBNF/plain/failing request) to stay in the CI budget.
CONFIGS = {
    "ngram-tree-overlap": (dict(draft="ngram", num_draft_tokens=6, overlap=True), False),
    "ngram-tree-sync": (dict(draft="ngram", num_draft_tokens=6, overlap=False), False),
    # every self-draft node verified: its drafts are rarely accepted (~1.1 tokens per forward
    # on SmolLM2), so the draft budget would cut most of them and leave little to check
    "self-chain-overlap": (
        dict(
            draft="self:2",
            topk=1,
            num_steps=4,
            num_draft_tokens=5,
            overlap=True,
            draft_budget=False,
        ),
        True,
    ),
    "self-tree-sync": (
        dict(
            draft="self:2",
            topk=3,
            num_steps=3,
            num_draft_tokens=6,
            overlap=False,
            draft_budget=False,
        ),
        True,
    ),
    # no tree fills: the greedy walks ask the matchers token by token
    "ngram-tree-lazy": (dict(draft="ngram", num_draft_tokens=6, lazy_grammar=True), True),
}
SMALL_SCHEMAS = 8
# xgrammar gets every config (overlap off with the n-gram drafter only under --run-slow, the
# model-tree config covers it); the other backends the default drafter
CASES = [
    pytest.param(b, c, marks=[pytest.mark.slow] if c == "ngram-tree-sync" else [])
    for b in BACKENDS
    for c in (CONFIGS if b == "xgrammar" else ("ngram-tree-overlap", "ngram-tree-lazy"))
]


def _schemas() -> list[dict]:
    by_id = {r["id"]: r for r in jsonschemabench_sample()}
    return [by_id[i] for i in SCHEMA_IDS]


@functools.cache
def batch(name: str) -> tuple[list[tuple[str, object]], list[Request]]:
    """(kind, oracle) per request and the requests: schemas, regexes, EBNF (if supported), a
    plain prompt, and the two grammars that fail to compile."""
    _, tok = model_and_tokenizer()
    caps = backend(name).capabilities
    kinds: list[tuple[str, object]] = []
    reqs: list[Request] = []
    params = SamplingParams(max_new_tokens=MAX_NEW)

    def add(kind, oracle, text, spec):
        kinds.append((kind, oracle))
        reqs.append(
            Request(
                prompt=build_prompt(tok, text),
                grammar=spec,
                sampling=params,
                rid=f"{kind}-{len(reqs)}",
            )
        )

    for r in _schemas():
        add("json", r["schema"], JSON_PROMPT, JsonSchema(r["schema"]))
    for pattern in REGEXES:
        add("regex", pattern, "Answer briefly.", Regex(pattern))
    if caps.ebnf:
        for text in EBNF:
            add("ebnf", None, "Answer briefly.", Ebnf(text))
    add("plain", None, "Name three colors.", None)
    for spec in BAD:
        add("bad", None, "Answer briefly.", spec)
    return kinds, reqs


def small(name: str) -> list[int]:
    """Indices of the sub-batch: the first SMALL_SCHEMAS schemas and every non-JSON request."""
    kinds, _ = batch(name)
    return [i for i, (k, _) in enumerate(kinds) if k != "json" or i < SMALL_SCHEMAS]


def run(name: str, indices: list[int] | None = None, **options) -> list:
    model, tok = model_and_tokenizer()
    _, reqs = batch(name)
    if indices is not None:
        reqs = [reqs[i] for i in indices]
    with SpecWorker(model, tok, backend=backend(name), **options) as worker:
        return worker.run(reqs)


@functools.cache
def reference(name: str) -> list:
    return run(name, no_spec=True)


@pytest.mark.parametrize("name", BACKENDS)
def test_no_spec_outputs_are_valid(name):
    kinds, reqs = batch(name)
    results = reference(name)
    finished = {"json": 0, "regex": 0, "ebnf": 0}
    for (kind, oracle), req, res in zip(kinds, reqs, results):
        if kind == "bad":
            assert res.finish_reason == "error" and res.error and res.num_tokens == 0, res
            continue
        assert res.finish_detail in ("grammar", "length", "eos"), res
        if kind == "plain":
            continue
        assert replays(name, req.grammar, res.token_ids, res.finish_detail == "grammar"), res
        if res.finish_detail != "grammar":
            assert res.num_tokens == MAX_NEW
            continue
        finished[kind] += 1
        if kind == "json":
            jsonschema.Draft202012Validator(oracle).validate(json.loads(res.text))
        elif kind == "regex":
            assert re.fullmatch(oracle, res.text), res.text
    assert finished["json"] >= 3 and finished["regex"] >= 2, (
        f"too few completed outputs to check: {finished}"
    )


@pytest.mark.parametrize("name,config", CASES)
def test_speculative_output_equals_no_spec(name, config):
    kinds, _ = batch(name)
    options, sub = CONFIGS[config]
    indices = small(name) if sub else list(range(len(kinds)))
    ref = [reference(name)[i] for i in indices]
    got = run(name, indices, **options)
    assert len(got) == len(indices)
    for i, r, g in zip(indices, ref, got):
        kind = kinds[i][0]
        assert (g.token_ids, g.finish_reason) == (r.token_ids, r.finish_reason), (
            kind,
            r.rid,
            r.text,
            g.text,
        )
        if kind == "bad":
            assert g.error == r.error
    spec_steps = sum(g.steps for g in got)
    assert spec_steps < sum(r.steps for r in ref), "speculation never accepted a draft token"


def test_graph_steps_place_grammar_work_inline_or_in_thread():
    """With CUDA graphs (emulated on CPU: the captured function runs at the replay) each step's
    grammar work runs inline on the calling thread or in the grammar thread, as its
    ``StepStats`` says (the placement policy tries both first); the outputs equal plain
    constrained decoding."""
    import threading

    name = "xgrammar"
    model, tok = model_and_tokenizer()
    _, reqs = batch(name)
    indices = small(name)
    runner = make_runner(model, "emulated")
    threads: list[str] = []

    class ObservedWorker(SpecWorker):
        def grammar_work(self, *args):
            threads.append(threading.current_thread().name)
            return super().grammar_work(*args)

    with ObservedWorker(
        runner, tok, backend=backend(name), draft="ngram", num_draft_tokens=6
    ) as worker:
        got = worker.run([reqs[i] for i in indices])
        flags = [s.grammar_in_thread for s in worker.step_stats]
    assert runner._graphs.launches == len(flags) == len(threads)
    assert True in flags and False in flags
    for flag, thread in zip(flags, threads):
        assert thread.startswith("spec-grammar") if flag else thread == threading.main_thread().name
    for i, g in zip(indices, got):
        r = reference(name)[i]
        assert (g.token_ids, g.finish_reason) == (r.token_ids, r.finish_reason), (
            r.rid,
            r.text,
            g.text,
        )


@pytest.mark.parametrize("early", [False, True], ids=["on-demand", "early"])
def test_graph_steps_mask_forbidden_greedy_tokens_on_demand_or_early(monkeypatch, early):
    """Greedy verification masks on the device only rows whose grammar forbids the forward's
    greedy token (real SmolLM2 wants such tokens in some steps), or every grammar row
    early while the forward runs (forced here; CUDA forwards decide it from measured times):
    the outputs equal plain constrained decoding either way."""
    import spec_grammar.worker.engine as engine
    from spec_grammar.worker.placement import EarlyMask

    name = "xgrammar"
    model, tok = model_and_tokenizer()
    _, reqs = batch(name)
    indices = small(name)
    launches = []
    real = engine.launch_masked_rows
    monkeypatch.setattr(engine, "launch_masked_rows", lambda *a: launches.append(1) or real(*a))
    monkeypatch.setattr(EarlyMask, "worth_it", lambda self, since_ms: early)
    with SpecWorker(
        make_runner(model, "emulated"),
        tok,
        backend=backend(name),
        draft="ngram",
        num_draft_tokens=6,
    ) as worker:
        got = worker.run([reqs[i] for i in indices])
        share = worker._early_mask.forbidden_share
        stats = list(worker.step_stats)
    assert bool(launches) == early
    assert share > 0  # steps met forbidden greedy tokens (the on-demand path ran)
    assert any(s.forbidden_rows for s in stats)
    assert any(s.early_mask for s in stats) == early
    for i, g in zip(indices, got):
        r = reference(name)[i]
        assert (g.token_ids, g.finish_reason) == (r.token_ids, r.finish_reason), (
            r.rid,
            r.text,
            g.text,
        )


def test_graph_steps_switch_between_tree_fills_and_lazy_walks(monkeypatch):
    """CUDA-graph steps (emulated) choose per step between filling the trees under the forward
    and lazy walks (:class:`LazyGrammar`; alternated here): the matcher of a request is fed each
    committed token exactly once across the switches, and the outputs equal plain constrained
    decoding."""
    from spec_grammar.worker.placement import LazyGrammar

    name = "xgrammar"
    model, tok = model_and_tokenizer()
    _, reqs = batch(name)
    indices = small(name)
    turn = iter(range(10**6))
    monkeypatch.setattr(
        LazyGrammar,
        "use_lazy",
        lambda self, rows, requests, launch_ms, forward_ms: next(turn) % 3 != 0,
    )
    with SpecWorker(
        make_runner(model, "emulated"),
        tok,
        backend=backend(name),
        draft="ngram",
        num_draft_tokens=6,
    ) as worker:
        got = worker.run([reqs[i] for i in indices])
        stats = list(worker.step_stats)
    lazy = [s.lazy_requests > 0 for s in stats]
    assert True in lazy and False in lazy
    assert any(
        s.forbidden_rows for s, z in zip(stats, lazy) if z
    )  # lazy walks masked refused tokens too
    for i, g in zip(indices, got):
        r = reference(name)[i]
        assert (g.token_ids, g.finish_reason) == (r.token_ids, r.finish_reason), (
            r.rid,
            r.text,
            g.text,
        )


class OracleDrafter(Drafter):
    """Drafts a fixed continuation per request (the no-spec output, then the stop token, then
    junk), so whole runs past EOS / grammar completion / the token budget are accepted at once."""

    def __init__(self, continuations: dict[str, list[int]], num_draft_tokens: int):
        super().__init__(num_draft_tokens=num_draft_tokens)
        self.continuations = continuations

    def propose(self, batch):
        out = []
        for s in batch:
            rest = self.continuations[s.rid][len(s.output_ids) :]
            out.append(DraftTree.chain(s.root_token, rest[: self.num_draft_tokens - 1]))
        return out


def test_truncation_inside_accepted_run():
    """EOS / grammar completion / max_new_tokens / a stop string inside an accepted draft run
    end the request there; the tokens drafted after it are dropped."""
    name = "xgrammar"
    model, tok = model_and_tokenizer()
    kinds, reqs = batch(name)
    ref = reference(name)
    eos = tok.eos_token_id
    picks = [i for i, (k, _) in enumerate(kinds) if k != "bad"]
    grammar_done = [i for i in picks if ref[i].finish_detail == "grammar"][:3]
    eos_plain = [i for i in picks if ref[i].finish_detail == "eos"][:1]
    length_cut = [i for i in picks if ref[i].finish_reason == "length"][:2]
    chosen = grammar_done + eos_plain + length_cut
    assert grammar_done and length_cut
    junk = tok.encode(' {"x": 1} more text')
    conts = {reqs[i].rid: ref[i].token_ids + [eos] + junk for i in chosen}
    sub = [reqs[i] for i in chosen]
    # a stop string that first appears inside the first length-cut output
    plain_ids = ref[length_cut[0]].token_ids
    stop_at = max(2, len(plain_ids) // 2)
    stop_str = tok.decode(plain_ids[stop_at - 1 : stop_at]).strip() or tok.decode(
        plain_ids[:stop_at]
    )
    text_so_far = tok.decode(plain_ids)
    first = min(k for k in range(1, len(plain_ids) + 1) if stop_str in tok.decode(plain_ids[:k]))
    stop_req = Request(
        prompt=reqs[length_cut[0]].prompt,
        grammar=reqs[length_cut[0]].grammar,
        sampling=SamplingParams(max_new_tokens=MAX_NEW, stop=[stop_str]),
        rid="stop-string",
    )
    conts["stop-string"] = plain_ids + junk
    drafter = OracleDrafter(conts, num_draft_tokens=64)
    with SpecWorker(model, tok, backend=backend(name), draft=drafter) as worker:
        got = worker.run(sub + [stop_req])
    for i, g in zip(chosen, got):
        assert (g.token_ids, g.finish_reason) == (ref[i].token_ids, ref[i].finish_reason), g
        assert g.steps == 1, "the whole run was drafted: one verify step must commit it"
    s = got[-1]
    assert s.finish_detail == "stop_string" and s.token_ids == plain_ids[:first], (stop_str, s)
    assert stop_str not in s.text and text_so_far.startswith(s.text)


def test_mixed_batch_sampling_and_failures():
    """Grammar + plain + sampled requests with two failing grammars in one batch: the failures
    end alone with their error, the rest complete; sampled grammar outputs stay valid and a
    fixed seed reproduces them."""
    name = "xgrammar"
    model, tok = model_and_tokenizer()
    schema = _schemas()[12]["schema"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=12)
    reqs = [
        Request(
            build_prompt(tok, "A JSON record."), JsonSchema(schema), sampled, rid="json-sampled"
        ),
        Request(build_prompt(tok, "Pick one."), Regex(REGEXES[0]), sampled, rid="regex-sampled"),
        Request(
            build_prompt(tok, "Say hi."), None, SamplingParams(max_new_tokens=8), rid="plain-short"
        ),
        Request(
            build_prompt(tok, "Answer."), BAD[0], SamplingParams(max_new_tokens=8), rid="bad-schema"
        ),
        Request([], None, SamplingParams(max_new_tokens=8), rid="empty-prompt"),
    ]
    outs = []
    for _ in range(2):
        with SpecWorker(model, tok, backend=backend(name), draft="ngram") as worker:
            outs.append(worker.run(reqs))
    a, b = outs
    assert [r.token_ids for r in a] == [r.token_ids for r in b], (
        "a fixed seed must reproduce the run"
    )
    assert a[3].finish_reason == "error" and "strin" in a[3].error
    assert a[4].finish_reason == "error" and "empty" in a[4].error
    assert a[2].finish_reason in ("stop", "length") and a[2].num_tokens > 0
    for req, res in zip(reqs[:2], a[:2]):
        assert res.finish_detail in ("grammar", "length") and res.num_tokens > 0
        assert replays(name, req.grammar, res.token_ids, res.finish_detail == "grammar")
        if res.finish_detail == "grammar" and isinstance(req.grammar, JsonSchema):
            jsonschema.Draft202012Validator(schema).validate(json.loads(res.text))


def test_cli_generate_json(tmp_path):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    f = tmp_path / "f.json"
    f.write_text(json.dumps(schema))
    cmd = [
        sys.executable,
        "-m",
        "spec_grammar",
        "generate",
        "--json-schema",
        str(f),
        "Invent a person.",
        "--max-new-tokens",
        "16",
        "--json",
        "--device",
        "cpu",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    [res] = out["results"]
    assert res["finish_detail"] in ("grammar", "length") and res["num_tokens"] > 0
    assert proc.returncode == (3 if res["finish_detail"] == "length" else 0)  # 3: cut output
    if res["finish_detail"] == "grammar":
        jsonschema.Draft202012Validator(schema).validate(json.loads(res["text"]))
    assert out["summary"]["requests"] == 1 and out["summary"]["errors"] == 0
    # on CPU: our fused decoder (SmolLM2 is a Llama), no graphs
    assert {k: out["runner"][k] for k in ("device", "decoder", "cuda_graphs")} == {
        "device": "cpu",
        "decoder": "fused",
        "cuda_graphs": False,
    }
    # every step says what the draft budget kept and how long it predicted the step would take
    steps = out["steps"]
    assert len(steps) == out["summary"]["steps"] and steps[0]["predicted_ms"] is None
    assert all(s["num_nodes"] <= s["proposed_nodes"] for s in steps)
    assert all(s["predicted_ms"] > 0 for s in steps[2:] if s["batch_size"])  # after 2 measured
    assert out["runner"]["forced_tokens"] is DEFAULT_FORCED_TOKENS  # says whether it is on
    assert out["runner"]["draft_budget"] is True  # on by default (--no-draft-budget: off)
    assert out["runner"]["cpu_projections"] == cpu_gemm.status()  # "on", or why not
    assert out["runner"]["cpu_attention"] == cpu_attention.status()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--json-schema", "/nonexistent/s.json", "hi"], "not found"),
        (
            ["generate", "--grammar-backend", "no-such-backend", "--regex", "a", "hi"],
            "unknown grammar backend",
        ),
        (["generate", "--json-schema", "{bad}", "hi"], "inline JSON is not valid"),
        (["generate", "--ebnf", "/nonexistent/g.ebnf", "hi"], "not found"),
    ],
)
def test_cli_errors(argv, needle, capsys):
    from spec_grammar.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_cli_bad_schema_file(tmp_path, capsys):
    from spec_grammar.cli import main

    f = tmp_path / "s.json"
    f.write_text("[1, 2")
    assert main(["generate", "--json-schema", str(f), "hi"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    f.write_text("[1, 2]")
    assert main(["generate", "--json-schema", str(f), "hi"]) == 2
    assert "JSON schema must be an object" in capsys.readouterr().err
