"""``spec-grammar bench gpu`` on the CPU (``--quick``: 2-layer random model, real SmolLM2
tokenizer, real xgrammar): every mode of every configuration commits exactly the valid document
(a fresh matcher accepted it) in the same number of steps, and the report files are written;
the replay drafter's wrong drafts are never the document's token and the replay runner's
greedy rows follow the document; its on-device document edit (eager and under emulated CUDA
graphs) changes only the document's rows and refuses what it cannot edit."""

import functools
import json

import pydantic
import pytest
import torch
from emulated_graphs import ReplayEagerly
from spec_grammar_bench import gpu
from spec_grammar_bench.gpu import (
    GpuBenchConfig,
    ReplayDrafter,
    _ReplayRunner,
    _wrong_tokens,
)

from spec_grammar.cli import main
from spec_grammar.testing.model_shapes import build_model
from spec_grammar.tree import DraftTree

pytestmark = pytest.mark.integration  # runs the bench CLI


def test_quick_cli_run(tmp_path):
    argv = [
        "bench",
        "gpu",
        "--quick",
        "--batches",
        "2",
        "--nodes",
        "8",
        "--eager-batches",
        "2",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
        "--name",
        "q",
    ]
    assert main(argv) == 0  # 1 when some mode's output differs from the document
    res = json.loads((tmp_path / "q.json").read_text())
    assert res["problems"] == [] and res["skipped"] == [] and len(res["rows"]) == 1
    row = res["rows"][0]
    modes = ("plain", "overlap", "sync", "eager")
    # same trees, same agreeing target: every mode commits the whole document in the same steps
    assert len({row[m]["steps"] for m in modes}) == 1
    assert {row[m]["tokens"] for m in modes} == {
        2 * row["batch"] * (row["doc_tokens"] - 1)
    }  # 2 rounds
    assert row["forward_ms"] > 0 and row["ratio"] > 0 and row["overlap"]["grammar_ms"] > 0
    assert len(row["ratio_rounds"]) == 2 and all(
        r > 0 for r in row["ratio_rounds"]
    )  # one per round
    # the target applies where the whole grammar work (every tree row filled, in order) is
    # shorter than the forward, whatever the overlap mode's lazy steps left of it
    assert row["target_applies"] == (row["sync"]["grammar_ms"] < row["forward_ms"])
    assert 0.0 <= row["overlap"]["lazy_share"] <= 1.0 and row["sync"]["lazy_share"] == 0.0
    md = (tmp_path / "q.md").read_text()
    # one configuration + batch-1 forwards at 1 and 8 nodes, each for the fused decoder (our
    # default for this Llama model on CPU too) and HF's forward beside it
    assert md.count("| tiny | smollm2 |") == 1 + 2 * 2
    lo, hi = min(row["ratio_rounds"]), max(row["ratio_rounds"])
    assert f"| {lo:.3f}-{hi:.3f} |" in md
    for png in ("q-step.png", "q-ratio.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG" and png in md


def test_lazy_grammar_flag_reaches_the_overlapped_modes_only(tmp_path):
    argv = [
        "bench",
        "gpu",
        "--quick",
        "--batches",
        "2",
        "--nodes",
        "8",
        "--eager-batches",
        "2",
        "--lazy-grammar",
        "on",
        "--out",
        str(tmp_path),
        "--name",
        "q",
    ]
    assert main(argv) == 0
    row = json.loads((tmp_path / "q.json").read_text())["rows"][0]
    assert row["overlap"]["lazy_share"] == row["eager"]["lazy_share"] == 1.0
    assert row["sync"]["lazy_share"] == 0.0  # the in-order fill is the applicability measure
    assert "lazy verification always" in (tmp_path / "q.md").read_text()


def test_replay_drafter_wrong_tokens_are_wrong():
    doc = [5, 9, 5, 7, 11, 13, 9, 17, 2]
    wrong = _wrong_tokens(doc, frozenset({2}))
    for rate in (0.0, 0.5, 1.0):
        d = ReplayDrafter(
            doc, num_draft_tokens=16, chain_depth=4, accept_rate=rate, wrong_token=wrong, seed=3
        )
        for pos in range(len(doc)):
            tree = d._tree(1, pos)
            for node in range(1, tree.num_nodes):
                depth = int(tree.depth[node])
                on_chain = tree.parent_list[node] == node - 1 and node <= d.chain_depth
                tok = tree.token_list[node]
                if on_chain and rate == 1.0:
                    assert tok == doc[pos + depth - 1]
                if on_chain and rate == 0.0:
                    assert tok != doc[pos + depth - 1]


def test_replay_runner_follows_document():
    torch.manual_seed(0)
    runner = _ReplayRunner(build_model("tiny", "cpu", torch.float32))
    prompt, doc = [10, 11, 12, 13], [40, 41, 42, 43, 44]
    runner.agree_with(len(prompt), doc)
    runner.add("a", prompt)
    runner.add("b", prompt + doc[:2])
    # a: root = last prompt token, chain of the first two document tokens; b: 2 tokens further
    trees = [DraftTree.chain(prompt[-1], doc[:2]), DraftTree.chain(doc[1], [doc[2]])]
    logits = runner.forward_trees(["a", "b"], trees)
    assert logits[0, :3].argmax(-1).tolist() == doc[:3]
    assert logits[1, :2].argmax(-1).tolist() == doc[2:4]
    runner.agree_with(None)
    plain = runner.forward_trees(["a"], trees[:1])
    assert plain[0, :3].argmax(-1).tolist() != doc[:3]  # random weights do not write the document


@pytest.fixture
def no_bench_run(monkeypatch):
    """Fail the test if the CLI gets as far as the run (where tokenizers and models load)."""

    def refuse(*_a, **_k):
        raise AssertionError("the benchmark started before the flag error was reported")

    monkeypatch.setattr(gpu, "run_gpu_bench", refuse)


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--batches", "0"], "--batches"),
        (["--batches", "-1"], "--batches"),
        (["--batches", ""], "--batches"),
        (["--models", ""], "--models"),
        (["--models", "unknown"], "--models"),
        (["--budget", "-1"], "--budget"),
        (["--eager-batches", "0"], "--eager-batches"),
        (["--nodes", "0"], "--nodes"),
        (["--accept-rate", "0"], "--accept-rate"),
        (["--accept-rate", "1.5"], "--accept-rate"),
        (["--accept-rate", "nan"], "--accept-rate"),
        (["--repeats", "0"], "--repeats"),
        (["--cooldown", "-1"], "--cooldown"),
        (["--cooldown", "nan"], "--cooldown"),
        (["--cooldown", "inf"], "--cooldown"),  # the report is JSON: no Infinity
        (["--budget", "inf"], "--budget"),
        (["--cases", "0"], "--cases"),
        (["--tokenizers", "bad=/nonexistent"], "--tokenizers"),
        (["--tokenizers", "nonsense"], "--tokenizers"),
        (["--device", "bogus"], "--device"),
        (
            ["--quick", "--cuda-graphs", "on"],
            "--cuda-graphs",
        ),  # graphs are never captured on the CPU
        (["--quick", "--batches", "2,0"], "--batches"),
    ],
)
def test_bad_flags_are_one_line_before_anything_loads(capsys, tmp_path, no_bench_run, flags, flag):
    rc = main(["bench", "gpu", *flags, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"spec-grammar bench: error: {flag}"), err
    assert not (tmp_path / "out").exists()  # no report of an invalid run


def test_tokenizer_directory_needs_tokenizer_json(capsys, tmp_path, no_bench_run):
    rc = main(["bench", "gpu", "--tokenizers", f"mine={tmp_path}", "--out", str(tmp_path / "out")])
    assert rc == 2 and "holds no tokenizer.json" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text("{}")
    assert (
        GpuBenchConfig(tokenizers=[f"mine={tmp_path}", str(tmp_path), "smollm2"]).tokenizers[0]
        == f"mine={tmp_path}"
    )


def test_config_checks_graphs_against_the_device():
    assert GpuBenchConfig(device="cuda:0", cuda_graphs=True).cuda_graphs is True
    assert GpuBenchConfig(device="cpu", cuda_graphs=False, eager_batches=[]).eager_batches == []
    with pytest.raises(pydantic.ValidationError, match="CUDA graphs need a CUDA device"):
        GpuBenchConfig(device="cpu", cuda_graphs=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(capsys, tmp_path, no_bench_run):
    rc = main(["bench", "gpu", "--device", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--device cuda: CUDA is not available" in err, err


def test_default_result_names_follow_the_gpu_model():
    from spec_grammar.cli.bench_gpu import default_name

    assert default_name("NVIDIA H200") == "gpu-h200"
    assert default_name("NVIDIA GeForce RTX 4090") == "gpu-rtx-4090"
    assert default_name("Tesla V100-SXM2-16GB") == "gpu-v100-sxm2-16gb"
    assert default_name("") == "gpu-cuda"


# -- the bench runner's document edit -----------------------------------------------------------
@functools.cache
def _tiny_float64():
    """A tiny random Llama in float64 (SmolLM2's vocabulary size)."""
    torch.manual_seed(0)
    return build_model("tiny", "cpu", torch.float64)


def _replay_runner(graphs: bool):
    return _ReplayRunner(_tiny_float64(), graphs=ReplayEagerly() if graphs else None)


def _tree_logits(runner, prompt, tree):
    runner.add("r", prompt)
    try:
        return runner.forward_trees(["r"], [tree])[0].clone()
    finally:
        runner.remove("r")


PROMPT = [5, 6, 7, 8]
TREE = DraftTree([8, 100, 101, 200], [-1, 0, 1, 0])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_agree_with_edits_only_document_rows(graphs):
    plain = _tree_logits(_replay_runner(graphs), PROMPT, TREE)
    runner = _replay_runner(graphs)
    document = [100, 101, 102]
    runner.agree_with(len(PROMPT), document)
    edited = _tree_logits(runner, PROMPT, TREE)
    # node depth d predicts document[d]: nodes 0 (d0), 1 (d1), 3 (d1), 2 (d2)
    assert edited.argmax(-1).tolist() == [100, 101, 102, 101]
    runner.agree_with(len(PROMPT), [])  # an empty document edits nothing
    assert torch.equal(_tree_logits(runner, PROMPT, TREE), plain)
    runner.agree_with(None)
    assert torch.equal(_tree_logits(runner, PROMPT, TREE), plain)


@pytest.mark.parametrize(
    "prompt_len, document",
    [(0, [1, 2]), (-3, [1, 2]), (4, [49152]), (1 << 15, [1]), (1, [1] * (1 << 15))],
    ids=[
        "zero-prompt",
        "negative-prompt",
        "token-past-vocab",
        "prompt-past-table",
        "doc-past-table",
    ],
)
def test_agree_with_rejects_what_it_cannot_edit(prompt_len, document):
    """Bad inputs get a ValueError at ``agree_with`` (never an index error inside a forward, a
    device-side assert inside a CUDA graph on a GPU) and leave the runner unedited."""
    runner = _replay_runner(False)
    plain = _tree_logits(_replay_runner(False), PROMPT, TREE)
    with pytest.raises(ValueError):
        runner.agree_with(prompt_len, document)
    assert torch.equal(_tree_logits(runner, PROMPT, TREE), plain)
