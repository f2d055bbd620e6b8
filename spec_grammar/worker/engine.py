"""The speculative worker: a batch loop of draft -> verify -> accept with grammar work
overlapped under the verify forward.

Per step (DESIGN.md section 4; SGLang's "Overlap grammar with speculative decode verify",
#31488, adapted to one CPU process):

1. **Draft** (``_draft``): one tree per live request (``Drafter.propose``), root = last
   committed token; trees deeper than the request's remaining token budget are cut, then
   the draft budget (:mod:`.draft_budget`) keeps the nodes that pay for their rows.
2. **Verify forward** (``_launch_verify``): ``ModelRunner.forward_trees`` over every node of
   every tree.
3. **Grammar work** (:meth:`SpecWorker.grammar_work`, :mod:`.grammar_work`), while step 2
   runs when ``overlap=True`` (after it otherwise). On CUDA with graphs either inline once the
   replay returns, or in the grammar thread started right before the replay, whose host-side
   launch (0.3-1 ms on an H200) releases the GIL: whichever the measured times predict faster
   (:mod:`.placement`; a thread started before the input preparation fought it for the GIL
   and slowed the launch 2-5x). On CPU or eager CUDA in the grammar thread from the start of
   the step, since the forward call itself keeps the calling thread busy. Every matcher is
   first advanced with the tokens the PREVIOUS step committed (each committed token reaches
   its matcher exactly once; a finished request's last run is fed too), then the tree rows of
   this step are filled (``GrammarBackend.fill_tree_bitmasks``). With ``grammar_threads > 1``
   the requests are split into contiguous groups of about equal node count and each group's
   advance + fill runs in its own thread, into its own rows of the step's host bitmask (a
   reused buffer of :class:`~.host_bitmask.HostBitmaskRing`).
4. **Accept** (``_accept_all``): greedy requests without penalties all at once: the forward's
   greedy token of every row (computed in its CUDA graph) is read back once and checked
   against one word of the host bitmask; only rows whose grammar forbids it are masked on the
   device (:mod:`.batch_verify`), or all grammar rows early while the forward runs where that
   pays (:class:`~.placement.EarlyMask`). Greedy grammar requests may also skip the tree fill
   (*lazy* verification, :class:`~.placement.LazyGrammar`): their walks ask the matcher to
   accept each greedy token they read and fill only a row whose greedy token it refuses, which
   pays where a step's tree fills would not hide under its forward. Other requests:
   ``process_tree_logits`` (penalties, grammar mask, temperature) then ``verify_greedy`` /
   ``verify_stochastic``. The committed run (accepted path tokens + bonus) is truncated at a
   stop token (EOS / grammar completion), a stop string or ``max_new_tokens``; unfinished
   requests ``commit`` the accepted path (the runner rolls the rest of the tree back).
5. **Accounting** (``_charge_grammar_time``, ``_record_measurements``, ``_step_stats``): each
   request's grammar time and the part of it exposed, the measurements the placement policies
   learn from, the step's :class:`~.request.StepStats`.

``overlap=False`` does the same work strictly in order, so temperature-0 outputs are identical
with and without overlap (the tests check it). The worker only talks to grammars through the
:class:`~spec_grammar.protocol.SpecGrammar` / :class:`~spec_grammar.protocol.GrammarBackend`
protocol.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from .. import compose
from ..errors import DraftTreeError, SpecGrammarError
from ..output_check import check_output
from ..protocol import GrammarBackend
from ..reasoning import reasoning_token_count, resolve_marker
from ..specs import ToolCalls
from ..tokenizer_info import TokenizerInfo
from ..tool_calls import parse_tool_calls
from ..tree import DraftTree
from .batch_verify import (
    GreedyRequest,
    batch_greedy_eligible,
    launch_masked_rows,
    verify_greedy_batch,
)
from .config import WorkerConfig, worker_config
from .draft_budget import DraftBudget
from .drafters import Drafter, NoDrafter
from .drafters.constrained import make_grammar_drafter
from .grammar_work import (
    Entry,
    GrammarWork,
    advance,
    group_entries,
    group_work,
    split_balanced,
)
from .host_bitmask import HostBitmaskRing
from .placement import EarlyMask, GrammarPlacement, LazyGrammar
from .request import (
    COMPLETED_DETAILS,
    Request,
    RequestError,
    RequestResult,
    RequestState,
    StepStats,
    check_request,
    finish_reason_of,
)
from .runner import ModelRunner
from .sampling import SamplingParams, make_generator, process_tree_logits
from .streaming import committed_text
from .verify import verify

__all__ = ["SpecWorker", "cut_tree_depth", "split_balanced", "context_length"]


def context_length(model: Any) -> int | None:
    """The most positions ``model`` (a Hugging Face causal LM or its config) takes:
    ``max_position_embeddings`` of its config (the text config of a multimodal one); None when
    it declares none."""
    config = getattr(model, "config", model)
    config = getattr(config, "text_config", None) or config
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def cut_tree_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without the nodes deeper than ``max_depth`` (node order kept)."""
    depth = tree.depth_list
    if max(depth) <= max_depth:
        return tree
    return tree.subtree([i for i in range(tree.num_nodes) if depth[i] <= max_depth])


def _checked_trees(batch: Sequence[RequestState], trees: Any) -> list[DraftTree]:
    """``trees`` as a list, checked to be one :class:`DraftTree` per request of ``batch``
    whose root is the request's last committed token (the :class:`Drafter` contract).
    Raises :class:`~spec_grammar.errors.DraftTreeError` naming what is wrong."""
    trees = list(trees)
    if len(trees) != len(batch):
        raise DraftTreeError(f"the drafter returned {len(trees)} trees for {len(batch)} requests")
    for st, tree in zip(batch, trees):
        if not isinstance(tree, DraftTree):
            raise DraftTreeError(f"the drafter returned a {type(tree).__name__}, not a DraftTree")
        if tree.token_list[0] != st.root_token:
            raise DraftTreeError(
                f"the drafter's tree is rooted at token {tree.token_list[0]}, not at the last "
                f"committed token {st.root_token}"
            )
    return trees


@dataclass(eq=False)
class _Step:
    """One step's requests and draft trees, and what each phase hands the next. Times are
    ``time.perf_counter()`` seconds: ``t0`` step start, ``t1`` drafted, ``t2`` verify forward
    returned, ``t3`` grammar work and device masking done; ``launched_at`` the graph replay's
    start (CUDA-graph steps with overlap that replayed; None otherwise)."""

    live: list[RequestState]
    trees: list[DraftTree]
    draining: list[RequestState]
    greedy: list[bool]  # verified by the batched greedy path (:func:`batch_greedy_eligible`)
    lazy: frozenset[str]  # ids of the requests verified lazily (no tree fill)
    bitmask: torch.Tensor | None  # (rows, W) int32 host rows of every filled tree
    t0: float
    t1: float
    t2: float = 0.0
    t3: float = 0.0
    launched_at: float | None = None
    in_thread: bool = False  # the grammar work ran in the grammar thread
    logits: torch.Tensor | None = None  # (B, N_max, V) from the verify forward
    top: torch.Tensor | None = None  # (B, N_max) int64 greedy token per row, when any greedy
    work: GrammarWork | None = None
    exposed_ms: float = 0.0  # grammar work beyond the forward
    gpu_ms: float | None = None  # the forward's GPU time, when measured
    proposed_nodes: int = 0  # nodes proposed (roots included), before the draft budget
    rows: int = 0  # rows the verify forward computes
    predicted_ms: float | None = None  # the draft budget's prediction of the whole step (t0 -> end)

    @property
    def rids(self) -> list[str]:
        return [st.rid for st in self.live]

    @property
    def with_argmax(self) -> bool:
        """The forward computes every row's greedy token (in its CUDA graph)."""
        return any(self.greedy)

    def grammar_args(self) -> tuple:
        """The arguments of :meth:`SpecWorker.grammar_work` for this step."""
        return self.live, self.trees, self.draining, self.bitmask, self.lazy


def _idle_step(ms: float) -> StepStats:
    """A step whose requests all ended while drafting: nothing verified."""
    return StepStats(
        batch_size=0,
        num_nodes=0,
        step_ms=ms,
        draft_ms=ms,
        verify_forward_ms=0.0,
        grammar_ms=0.0,
        grammar_exposed_ms=0.0,
        sample_ms=0.0,
        committed_tokens=0,
    )


def _policy(name: str, policy: Any, cls: type) -> Any:
    """``policy`` (a fresh ``cls`` when None); ``TypeError`` naming ``name`` for anything that
    is not a ``cls`` (a subclass overriding its decisions is the way to pass another one)."""
    if policy is None:
        return cls()
    if not isinstance(policy, cls):
        raise TypeError(
            f"{name} must be None or an instance of {cls.__name__} (or a subclass), got "
            f"{type(policy).__name__}"
        )
    return policy


class SpecWorker:
    """Runs batches of requests with tree speculative decoding and grammar constraints.

    Args:
        model: a ``transformers`` causal LM (the target), or a ready
            :class:`~spec_grammar.worker.runner.ModelRunner` over it.
        tokenizer: its Hugging Face tokenizer.
        config: the worker's options (:class:`~spec_grammar.worker.config.WorkerConfig`:
            drafter and tree shape, ``no_spec``, ``overlap``, grammar threads, lazy
            verification, CUDA graphs, fused forward); ``**options`` override its fields.
            Without one, the options are ``**options`` over WorkerConfig's defaults, except
            ``forced_tokens``, False here so that a :class:`Drafter` instance passed in runs
            exactly as given (``generate`` and the CLI default it to
            :data:`~spec_grammar.worker.defaults.DEFAULT_FORCED_TOKENS`).
        backend: a :class:`~spec_grammar.protocol.GrammarBackend` built for this tokenizer
            with ``vocab_size`` = the model's logits width, a registered backend name, or
            None (then only plain requests are allowed; a grammar request fails alone).
        device: where the target runs (default: the model's device).
        placement: the policy placing a CUDA-graph step's grammar work inline or in the grammar
            thread (default: a fresh :class:`~.placement.GrammarPlacement`).
        lazy_policy: the policy choosing lazy verification when ``lazy_grammar`` is None
            (default: a fresh :class:`~.placement.LazyGrammar`).
        early_mask: the policy masking grammar rows on the device while the forward runs
            (default: a fresh :class:`~.placement.EarlyMask`).
        **options: :class:`~spec_grammar.worker.config.WorkerConfig` fields.

    Raises ``TypeError`` for a keyword that is no option, the option errors of
    :class:`~spec_grammar.worker.config.WorkerConfig`, ``TypeError`` for a ``placement`` /
    ``lazy_policy`` / ``early_mask`` of the wrong class, ``ValueError`` for a backend whose
    vocabulary size differs from the model's logits width or an unknown drafter name.

    Stats: :attr:`step_stats` holds one :class:`StepStats` per step of the last :meth:`run`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: WorkerConfig | None = None,
        *,
        backend: GrammarBackend | str | None = "xgrammar",
        device: Any = None,
        placement: GrammarPlacement | None = None,
        lazy_policy: LazyGrammar | None = None,
        early_mask: EarlyMask | None = None,
        **options: Any,
    ):
        if config is None:
            options.setdefault("forced_tokens", False)
        self.config = cfg = worker_config(config, options, "SpecWorker.__init__")
        # the policies first: a wrong object fails here, not in the middle of a run
        self._placement = _policy("placement", placement, GrammarPlacement)
        self._early_mask = _policy("early_mask", early_mask, EarlyMask)
        self._lazy = _policy("lazy_policy", lazy_policy, LazyGrammar)
        self.runner = (
            model
            if isinstance(model, ModelRunner)
            else ModelRunner(
                model, device=device, cuda_graphs=cfg.cuda_graphs, fused_forward=cfg.fused_forward
            )
        )
        self.tokenizer = tokenizer
        self._plain_token_info: TokenizerInfo | None = None
        self.backend = self._grammar_backend(backend)
        self.drafter = self._make_drafter()
        self._budget = DraftBudget() if cfg.draft_budget else None
        self._drafted: set[str] = set()  # the requests the drafter ran for this step
        self.stop_token_ids = self._stop_tokens()
        self.step_stats: list[StepStats] = []
        self._pool: ThreadPoolExecutor | None = None
        self._group_pool: ThreadPoolExecutor | None = None
        self._open_pools()
        self._bitmasks = (
            HostBitmaskRing(self.backend.vocab_size, pin=self.runner.device.type == "cuda")
            if self.backend is not None
            else None
        )
        self._cancel_lock = threading.Lock()
        self._running: set[str] = set()
        self._cancelled: set[str] = set()

    @property
    def no_spec(self) -> bool:
        """``config.no_spec``: plain constrained decoding (root-only trees)."""
        return self.config.no_spec

    @property
    def overlap(self) -> bool:
        """``config.overlap``: grammar work under the verify forward."""
        return self.config.overlap

    @property
    def grammar_threads(self) -> int:
        """Threads sharing a step's grammar work (``config.grammar_threads``, None = 1)."""
        return self.config.grammar_threads or 1

    @property
    def lazy_grammar(self) -> bool | None:
        """``config.lazy_grammar``: lazy verification always / never / as measured (None)."""
        return self.config.lazy_grammar

    def _grammar_backend(self, backend: GrammarBackend | str | None) -> GrammarBackend | None:
        """``backend`` (a registered name is built for this tokenizer), checked against the
        model's logits width."""
        if isinstance(backend, str):
            from ..registry import get_backend

            backend = get_backend(backend, self.tokenizer, vocab_size=self.runner.vocab_size)
        if backend is not None and backend.vocab_size != self.runner.vocab_size:
            raise ValueError(
                f"the grammar backend masks {backend.vocab_size} logits but the model has "
                f"{self.runner.vocab_size}; build it with vocab_size={self.runner.vocab_size}"
            )
        return backend

    def _make_drafter(self) -> Drafter:
        """The drafter the config names (root-only trees with ``no_spec``); a draft model runs
        on the target's device with the target's runner settings."""
        cfg = self.config
        if cfg.no_spec:
            return NoDrafter()
        return make_grammar_drafter(
            cfg.draft,
            constrain_draft=cfg.constrain_draft,
            forced_tokens=cfg.forced_tokens,
            target_model=self.runner.model,
            device=self.runner.device,
            cuda_graphs=cfg.cuda_graphs,
            fused_forward=cfg.fused_forward,
            topk=cfg.topk,
            num_steps=cfg.num_steps,
            num_draft_tokens=cfg.num_draft_tokens,
        )

    def _stop_tokens(self) -> frozenset[int]:
        """The tokens that end a request: the grammar backend's stop tokens, or without a
        backend the tokenizer's EOS token(s)."""
        if self.backend is not None:
            stops = self.backend.tokenizer_info.stop_token_ids
        else:
            eos = self.tokenizer.eos_token_id
            stops = (eos,) if isinstance(eos, int) else tuple(eos)
        return frozenset(int(t) for t in stops)

    def cancel(self, rid: str) -> None:
        """Cancel the running request ``rid``; callable from any thread (an ``on_step``
        callback, another thread, even while a step runs). The request ends after the current
        step with ``finish_reason="cancelled"`` and the tokens committed so far; its KV cache
        and matcher are released, the other requests go on untouched.

        Raises ``KeyError`` when no request with that id is running.
        """
        with self._cancel_lock:
            if rid not in self._running:
                raise KeyError(f"no running request {rid!r}")
            self._cancelled.add(rid)

    def _drop_cancelled(self, live: list[RequestState]) -> list[RequestState]:
        """``live`` without the requests cancelled so far (they are finished and released)."""
        with self._cancel_lock:
            hit, self._cancelled = self._cancelled, set()
            self._running = {s.rid for s in live if s.rid not in hit}
        if not hit:
            return live
        now = time.perf_counter()
        for st in live:
            if st.rid in hit:
                st.finish("cancelled", now, "cancelled by the caller")
                self._release(st)
        return [s for s in live if s.rid not in hit]

    def _open_pools(self) -> None:
        """Start the grammar threads (again after :meth:`close`)."""
        if self.overlap and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spec-grammar")
        # the thread running a step's grammar work takes the first group itself, so the group
        # pool is a second pool (no pool ever waits on its own workers)
        if self.grammar_threads > 1 and self._group_pool is None:
            self._group_pool = ThreadPoolExecutor(
                max_workers=self.grammar_threads - 1, thread_name_prefix="spec-grammar-group"
            )

    def close(self) -> None:
        """Stop the grammar threads (a later :meth:`run` starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._group_pool is not None:
            self._group_pool.shutdown(wait=True)
            self._group_pool = None

    def __enter__(self) -> SpecWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- setup ------------------------------------------------------------------------------
    def _start(self, req: Request, now: float) -> RequestState:
        try:
            params = check_request(req)
        except RequestError as e:
            st = RequestState(request=req, prompt_ids=[], sampling=SamplingParams(), start_s=now)
            st.finish("error", now, str(e))
            return st
        if isinstance(req.prompt, str):
            ids = list(self.tokenizer.encode(req.prompt))
        else:
            ids = [int(t) for t in req.prompt]
        st = RequestState(request=req, prompt_ids=ids, sampling=params, start_s=now)
        if not ids:
            st.finish("error", now, "the prompt is empty")
            return st
        ctx = context_length(self.runner.model)
        if ctx is not None:
            room = ctx - len(ids) - self.config.num_draft_tokens  # the last tree's positions too
            if room < 1:
                st.finish(
                    "error",
                    now,
                    f"the prompt is {len(ids)} tokens; the model's context is {ctx} tokens "
                    f"({self.config.num_draft_tokens} kept for a draft tree): shorten the prompt",
                )
                return st
            if params.max_new_tokens > room:  # as vLLM does: clamp and say it
                st.warnings += (
                    f"max_new_tokens={params.max_new_tokens} is past the model's context "
                    f"({ctx} tokens, prompt {len(ids)}): clamped to {room}",
                )
                st.sampling = params = params.model_copy(update={"max_new_tokens": room})
        if req.grammar is not None:
            if self.backend is None:
                st.finish(
                    "error", now, "this request has a grammar but the worker has no grammar backend"
                )
                return st
            try:
                compiled = self.backend.compile(req.grammar)
                st.matcher = compose.matcher(
                    self.backend,
                    compiled,
                    reasoning_end=req.reasoning_end,
                    max_reasoning_tokens=req.max_reasoning_tokens,
                )
                st.warnings += compiled.warnings
                st.backend_name = compiled.backend_name
                st.backend_reason = compiled.route
            except SpecGrammarError as e:
                st.finish("error", now, str(e))
                return st
        st.generator = make_generator(params, self.runner.device)
        if params.max_new_tokens <= 0:
            st.finish("length", now)
        return st

    def _prefill(self, states: Sequence[RequestState], now: float) -> None:
        """Prefill the started requests together (:meth:`ModelRunner.add_batch`, then the
        drafter's :meth:`~.drafters.Drafter.add_batch`); one the runner or the drafter refuses
        (e.g. token ids outside a vocabulary) ends with its reason, and so does a request whose
        id an earlier request of the run already has (the runner, the drafter and the results
        know requests by id)."""
        seen: set[str] = set()
        for st in states:
            if st.rid in seen:
                st.finish(
                    "error",
                    now,
                    f"request id {st.rid!r} is already used by another request of this run",
                )
            seen.add(st.rid)
        states = [st for st in states if not st.finished]
        refused = self.runner.add_batch([(st.rid, st.prompt_ids) for st in states])
        for st in states:
            if st.rid in refused:
                st.finish("error", now, str(refused[st.rid]))
        started = [st for st in states if not st.finished]
        refused = self.drafter.add_batch(started)
        for st in started:
            if st.rid in refused:
                st.finish("error", now, f"the drafter refused the request: {refused[st.rid]}")
                self._release(st)
        if self.runner.device.type == "cuda":
            # a batched prefill is compute-bound: its forwards run on after their launches
            # return, and the first step's forward would wait for them inside its timer (seen:
            # ~25 ms, 32 prompts on the 8B shape on the H200, +2 ms on every step's mean)
            torch.cuda.current_stream(self.runner.device).synchronize()

    # -- grammar work (the overlapped part) -------------------------------------------------
    def grammar_work(
        self,
        live: Sequence[RequestState],
        trees: Sequence[DraftTree],
        draining: Sequence[RequestState],
        bitmask: torch.Tensor | None,
        lazy: Collection[str] = (),
    ) -> GrammarWork:
        """The grammar phase of a step: advance every matcher with the tokens the previous
        step committed, then fill the token bitmask rows of every tree (:mod:`.grammar_work`),
        request groups in parallel (this thread takes the first), merged in request order.

        Args:
            live: the step's requests; ``trees`` their draft trees.
            draining: finished requests whose matchers still take their last tokens.
            bitmask: ``(rows, W)`` int32 host buffer with one row per node of every live
                grammar request not in ``lazy``, in request order (None: no such request).
            lazy: ids of the requests verified lazily (advanced, first branch pre-accepted, no
                rows).

        Runs inline or in the grammar thread, under the verify forward when ``overlap``.
        Grammar faults end their request only (:attr:`GrammarWork.errors`). Subclasses may
        wrap it (the tests do, to watch where and when it runs); benchmarks time it alone.
        """
        t0 = time.perf_counter()
        parts = group_entries(live, trees, draining, lazy, self.grammar_threads)
        if len(parts) <= 1:
            done = [self._group_work(parts[0] if parts else [], bitmask)]
        else:
            futs = [self._group_pool.submit(self._group_work, p, bitmask) for p in parts[1:]]
            try:
                first = self._group_work(parts[0], bitmask)
            finally:
                wait(futs)  # no group may still write the bitmask once this returns or raises
            done = [first] + [f.result() for f in futs]
        work = GrammarWork.merge(done, bitmask)
        work.ms = (time.perf_counter() - t0) * 1e3
        return work

    def _group_work(self, entries: Sequence[Entry], bitmask: torch.Tensor | None) -> GrammarWork:
        """Advance + fill of one group of the step's requests (:func:`.grammar_work.group_work`)."""
        return group_work(entries, bitmask, self.backend, self._drafted_rows)

    def _drafted_rows(
        self, st: RequestState, tree: DraftTree
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rows, valid)`` of ``tree`` kept by a grammar-aware drafter this step, or None
        (also for a request the drafter did not run for: it may still hold an older step's)."""
        if st.rid not in self._drafted:
            return None
        return self.drafter.draft_rows(st.rid, tree)

    def _advance_matchers(
        self, live: Sequence[RequestState], draining: Sequence[RequestState]
    ) -> list[RequestState]:
        """Feed every matcher the committed tokens it has not seen, on this thread and outside
        any forward (before drafting from the grammar state, and after the last step): the
        time counts as exposed grammar time. Returns the live requests still running (a
        refused token ends its request with an error)."""
        work = GrammarWork()
        for st in list(draining) + list(live):
            if st.matcher is None:
                continue
            ts = time.perf_counter()
            advance(st, work)
            ms = (time.perf_counter() - ts) * 1e3
            st.grammar_ms += ms
            st.grammar_exposed_ms += ms
        now = time.perf_counter()
        self._apply_errors(work, draining, now)
        kept = []
        for st in live:
            if st.rid in work.errors:
                st.finish("error", now, work.errors[st.rid])
                self._release(st)
            else:
                kept.append(st)
        return kept

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self,
        requests: Sequence[Request],
        *,
        on_step: Callable[[StepStats, Sequence[RequestState]], None] | None = None,
    ) -> list[RequestResult]:
        """Generate every request; returns one :class:`RequestResult` per request, in order.

        A request whose grammar fails to compile (or whose prompt is empty) ends at once with
        ``finish_reason="error"`` and the reason; the others go on. ``on_step`` is called after
        every step with its stats and all request states (for progress displays).
        """
        self._open_pools()
        self.step_stats = []
        now = time.perf_counter()
        states = [self._start(r, now) for r in requests]
        live = [s for s in states if not s.finished]
        draining: list[RequestState] = []
        with self._cancel_lock:
            self._running = {s.rid for s in live}
        try:
            self._prefill(live, now)
            live = [s for s in live if not s.finished]
            while True:
                live = self._drop_cancelled(live)
                if not live:
                    break
                stats = self._step(live, draining)
                draining = [s for s in live if s.finished and s.matcher is not None and s.pending]
                live = [s for s in live if not s.finished]
                self.step_stats.append(stats)
                if on_step is not None:
                    on_step(stats, states)
            self._advance_matchers([], draining)  # the last tokens of the last step's finishers
        finally:
            with self._cancel_lock:
                self._running, self._cancelled = set(), set()
            for st in live:
                self._release(st)
        return [self.result(s) for s in states]

    # -- one step: draft, verify (grammar work under it), accept, account -------------------
    def _step(self, live: list[RequestState], draining: list[RequestState]) -> StepStats:
        t0 = time.perf_counter()
        skip: frozenset[str] = frozenset()
        if self._budget is not None:
            drafts = self._budget.drafting(
                [st.rid for st in live],
                self.runner.forward_shape,
                fixed=[not st.sampling.greedy for st in live],
                fill=[st.matcher is not None for st in live],
            )
            skip = frozenset(st.rid for st, d in zip(live, drafts) if not d)
        live, draining, trees = self._draft(live, draining, skip)
        if not live:
            self._advance_matchers([], draining)  # the last tokens of requests that finished
            return _idle_step((time.perf_counter() - t0) * 1e3)
        proposed = sum(t.num_nodes for t in trees)
        # the requests whose tree rows the step's grammar work fills (one row without drafts)
        fill = [
            st.matcher is not None and self._drafted_rows(st, t) is None
            for st, t in zip(live, trees)
        ]
        drafted = [st.rid in self._drafted for st in live]
        if self._budget is not None:
            trees = self._budget.choose(
                [st.rid for st in live],
                trees,
                self.runner.forward_shape,
                fixed=[not st.sampling.greedy for st in live],
                fill=fill,
                drafted=drafted,
            )
        fwd_rows, padded = self.runner.forward_shape([t.num_nodes for t in trees])
        shape = (
            fwd_rows,
            padded,
            sum(t.num_nodes for t, f in zip(trees, fill) if f),
            sum(drafted),
        )
        predicted = self._budget.predict(*shape) if self._budget is not None else None
        t1 = time.perf_counter()
        greedy = [batch_greedy_eligible(st.sampling) for st in live]
        lazy = self._lazy_requests(live, trees, greedy)
        rows = sum(
            t.num_nodes for s, t in zip(live, trees) if s.matcher is not None and s.rid not in lazy
        )
        bitmask = self._bitmasks.acquire(rows) if rows else None
        step = _Step(live, trees, draining, greedy, lazy, bitmask, t0=t0, t1=t1)
        step.proposed_nodes, step.rows, step.predicted_ms = proposed, fwd_rows, predicted
        try:
            self._launch_verify(step)
            self._mask_on_device(step)
            self._charge_grammar_time(step)
            committed, lazy_ms = self._accept_all(step)
            if self._budget is not None:
                rows, padded, filled, n_drafted = shape
                ms = (time.perf_counter() - t0) * 1e3
                self._budget.record_step(rows, ms, padded, filled, n_drafted)
            self._record_measurements(step, lazy_ms)
            return self._step_stats(step, committed, sum(lazy_ms.values()))
        finally:
            if bitmask is not None:
                # every upload from this buffer was queued on the current stream by now
                self._bitmasks.record_upload(self.runner.device)

    def _draft(
        self, live: list[RequestState], draining: list[RequestState], skip: Collection[str] = ()
    ) -> tuple[list[RequestState], list[RequestState], list[DraftTree]]:
        """The draft phase: one draft tree per live request (:meth:`_propose`; a root-only tree
        for the requests in ``skip``, the draft budget's, without calling the drafter), cut to
        the request's remaining token budget. A drafter that drafts from the grammar state
        (:attr:`Drafter.needs_grammar_state`) gets every matcher advanced first, the draining
        ones included, when it runs for any request. Returns the requests still live, those
        still draining and the trees."""
        self._drafted = set()
        if self.drafter.needs_grammar_state and any(st.rid not in skip for st in live):
            live = self._advance_matchers(live, draining)
            draining = []
        if not live:
            return live, draining, []
        live, trees = self._propose(live, skip)
        trees = [
            cut_tree_depth(t, s.sampling.max_new_tokens - len(s.output_ids) - 1)
            for s, t in zip(live, trees)
        ]
        return live, draining, trees

    def _propose(
        self, live: list[RequestState], skip: Collection[str] = ()
    ) -> tuple[list[RequestState], list[DraftTree]]:
        """The drafter's trees for ``live`` (root-only trees for ``skip``, the drafter not
        called for them; :attr:`_drafted` is set to the ids it ran for). Drafting that raises (e.g. a grammar-aware
        drafter's matcher faulting) or returns what is not one tree per request rooted at its
        last committed token (:func:`_checked_trees`: a custom drafter's bug, which would
        otherwise fail the whole batch's forward or verify a request from a wrong token) is
        retried one request at a time: a request whose own drafting fails ends with an error
        (its committed tokens kept), the others go on. Returns the requests still live and
        their trees."""
        ask = [st for st in live if st.rid not in skip]
        got: dict[str, DraftTree] = {}
        if ask:
            try:
                got = dict(
                    zip([st.rid for st in ask], _checked_trees(ask, self.drafter.propose(ask)))
                )
            except Exception:
                for st in ask:
                    try:
                        (got[st.rid],) = _checked_trees([st], self.drafter.propose([st]))
                    except Exception as e:
                        msg = f"drafting failed: {type(e).__name__}: {e}"
                        st.finish("error", time.perf_counter(), msg)
                        self._release(st)
        self._drafted = set(got)
        kept = [st for st in live if st.rid in got or st.rid in skip]
        trees = [
            got[st.rid] if st.rid in got else DraftTree.chain(st.root_token, []) for st in kept
        ]
        return kept, trees

    def _lazy_requests(
        self, live: Sequence[RequestState], trees: Sequence[DraftTree], greedy: Sequence[bool]
    ) -> frozenset[str]:
        """Ids of the requests this step verifies lazily (no tree fill): greedy grammar
        requests, as ``lazy_grammar`` says (None: :class:`.LazyGrammar`'s choice on CUDA-graph
        steps with overlap). A request whose rows a grammar-aware drafter computed while
        drafting keeps them: they are its verification rows."""
        if self.lazy_grammar is False or (
            self.lazy_grammar is None and not (self.overlap and self.runner.uses_cuda_graphs)
        ):
            return frozenset()
        cands = [
            (st, t)
            for st, t, g in zip(live, trees, greedy)
            if g and st.matcher is not None and self._drafted_rows(st, t) is None
        ]
        if not cands:
            return frozenset()
        if self.lazy_grammar is None and not self._lazy.use_lazy(
            sum(t.num_nodes for _, t in cands),
            len(cands),
            self._placement.launch_ms,
            self._early_mask.forward_ms,
        ):
            return frozenset()
        return frozenset(st.rid for st, _ in cands)

    # -- verify forward with the grammar work under it ---------------------------------------
    def _launch_verify(self, step: _Step) -> None:
        """The verify forward over every node of every tree, with the step's grammar work
        (:meth:`grammar_work`) under it when ``overlap``: placed around a CUDA-graph replay as
        measured fastest (:meth:`_verify_with_graph`), else in the grammar thread from the
        start (the forward call itself keeps this thread busy), else strictly after it. Sets
        the step's logits (and greedy tokens), grammar work and ``t2``."""
        if self.overlap and self.runner.uses_cuda_graphs:
            out = self._verify_with_graph(step)
        elif self._pool is not None:
            out = self._verify_beside_thread(step)
        else:
            out = self._verify_then_grammar(step)
        step.logits, step.top = out if step.with_argmax else (out, None)

    def _verify_with_graph(self, step: _Step) -> Any:
        """The grammar work runs inline after the graph replay returns, or in the grammar
        thread started right before the replay (whose host-side launch releases the GIL; a
        thread started before the input preparation fought it for the GIL), whichever the
        measured times predict faster (:class:`~.placement.GrammarPlacement`). With no replay
        (an eager bucket) it runs inline after the launch while the GPU computes."""
        units = self._grammar_units(step)
        # (no pool: the caller closed the worker inside this run, e.g. from on_step)
        want_thread = units > 0 and self._pool is not None and self._placement.use_thread(units)
        started: list[Future] = []
        launched: list[float] = []

        def before_launch() -> None:
            launched.append(time.perf_counter())
            if want_thread:
                started.append(self._pool.submit(self.grammar_work, *step.grammar_args()))

        try:
            out = self.runner.forward_trees(
                step.rids, step.trees, before_launch=before_launch, with_argmax=step.with_argmax
            )
        except BaseException:
            wait(
                started
            )  # the grammar work writes the bitmask: it ends before the buffer is reused
            raise
        step.t2 = time.perf_counter()
        step.launched_at = launched[0] if launched else None
        step.in_thread = bool(started)
        if step.in_thread:
            step.work = started[0].result()
            # from the thread's start to this thread running again: both wake-ups count (on a
            # virtual machine a blocked thread can take a millisecond to run again)
            grammar_ms = (time.perf_counter() - step.launched_at) * 1e3
        else:
            step.work = self.grammar_work(*step.grammar_args())
            grammar_ms = step.work.ms
        if step.launched_at is not None and units:
            launch_ms = (step.t2 - step.launched_at) * 1e3
            self._placement.record(step.in_thread, units, grammar_ms, launch_ms)
        return out

    @staticmethod
    def _grammar_units(step: _Step) -> int:
        """The placement's measure of a step's grammar work: tree rows + draining requests +
        live grammar requests. Lazy requests are not counted: their work here (an advance and
        the first branch pre-accepted) is a few accepts, cheaper inline than a thread's
        hand-off."""
        return (
            (0 if step.bitmask is None else step.bitmask.shape[0])
            + len(step.draining)
            + sum(st.matcher is not None and st.rid not in step.lazy for st in step.live)
        )

    def _verify_beside_thread(self, step: _Step) -> Any:
        """The grammar work in the grammar thread from before the forward starts."""
        fut = self._pool.submit(self.grammar_work, *step.grammar_args())
        try:
            out = self.runner.forward_trees(step.rids, step.trees, with_argmax=step.with_argmax)
        except BaseException:
            wait([fut])  # the grammar work writes the bitmask: it ends before the buffer is reused
            raise
        step.t2 = time.perf_counter()
        step.work = fut.result()
        return out

    def _verify_then_grammar(self, step: _Step) -> Any:
        """No overlap: the forward, then (on CUDA once the forward has ended) the grammar work."""
        out = self.runner.forward_trees(step.rids, step.trees, with_argmax=step.with_argmax)
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
        step.t2 = time.perf_counter()
        step.work = self.grammar_work(*step.grammar_args())
        return out

    def _mask_on_device(self, step: _Step) -> None:
        """The step's device-side token bitmask work, if any (:meth:`_device_masks`); sets
        ``t3``."""
        if step.bitmask is not None:
            self._device_masks(
                step.work, step.logits, step.live, step.trees, step.greedy, step.launched_at
            )
        step.t3 = time.perf_counter()

    def _charge_grammar_time(self, step: _Step) -> None:
        """Each request's grammar milliseconds of the step, and the part exposed: the step's
        grammar bookkeeping before the verify's wait for the device; with a graph replay, what
        the grammar work took beyond the GPU's forward (0 while the forward still runs)."""
        work = step.work
        exposed, gpu_ms = (step.t3 - step.t2) * 1e3, None
        if step.launched_at is not None:
            gpu_ms = self.runner.last_forward_gpu_ms()
            # None: the forward still runs, so the grammar work ended under it
            exposed = 0.0 if gpu_ms is None else max(0.0, exposed - gpu_ms)
        frac = min(1.0, exposed / work.ms) if work.ms > 0 else 0.0
        for st in itertools.chain(step.live, step.draining):
            ms = work.per_request_ms.get(st.rid, 0.0)
            st.grammar_ms += ms
            st.grammar_exposed_ms += ms * frac
        step.exposed_ms, step.gpu_ms = exposed, gpu_ms

    # -- accept and commit ------------------------------------------------------------------
    def _accept_all(self, step: _Step) -> tuple[int, dict[str, float]]:
        """Accept length and bonus token of every request: the greedy ones verified together
        (:meth:`_verify_batch`), then each request's run committed (:meth:`_accept`). A request
        whose grammar failed ends with its error. Returns the tokens committed and the lazy
        walks' grammar milliseconds by request id (charged to the requests: after the
        forward, all exposed)."""
        work = step.work
        self._apply_errors(work, step.draining, step.t3)
        verified, lazy_ms = self._verify_batch(
            step.live, step.trees, step.logits, step.top, step.greedy, work, step.lazy
        )
        for st in step.live:
            if st.rid in lazy_ms:
                st.grammar_ms += lazy_ms[st.rid]
                st.grammar_exposed_ms += lazy_ms[st.rid]
        committed = 0
        for i, (st, tree) in enumerate(zip(step.live, step.trees)):
            st.steps += 1
            if st.rid in work.errors:
                st.finish("error", step.t3, work.errors[st.rid])
                self._release(st)
                continue
            try:
                committed += self._accept(
                    st,
                    tree,
                    step.logits[i, : tree.num_nodes],
                    work,
                    verified.get(i),
                    fed=st.rid in step.lazy,
                )
            except SpecGrammarError as e:  # e.g. a matcher left with no allowed token
                st.finish("error", time.perf_counter(), str(e))
                self._release(st)
        return committed, lazy_ms

    def _record_measurements(self, step: _Step, lazy_ms: dict[str, float]) -> None:
        """Feed the step's forward time and grammar cost to the early-mask and lazy policies
        (CUDA-graph steps that replayed, with grammar work; the forward has ended by now)."""
        if step.launched_at is None or (step.bitmask is None and not step.lazy):
            return
        gpu_ms = step.gpu_ms if step.gpu_ms is not None else self.runner.last_forward_gpu_ms()
        # one forward-time average serves both policies; a bad event reading (never seen) must
        # not raise here, after the step's tokens were committed
        if gpu_ms is not None and math.isfinite(gpu_ms) and gpu_ms >= 0:
            self._early_mask.record_forward(gpu_ms)
        if step.lazy:
            self._lazy.record_lazy(len(lazy_ms), sum(lazy_ms.values()))
        elif step.bitmask is not None:
            self._lazy.record_fill(step.bitmask.shape[0], step.work.ms)

    def _step_stats(self, step: _Step, committed: int, lazy_total: float) -> StepStats:
        t4 = time.perf_counter()
        return StepStats(
            batch_size=len(step.live),
            num_nodes=sum(t.num_nodes for t in step.trees),
            step_ms=(t4 - step.t0) * 1e3,
            draft_ms=(step.t1 - step.t0) * 1e3,
            verify_forward_ms=(step.t2 - step.t1) * 1e3,
            grammar_ms=step.work.ms + lazy_total,
            grammar_exposed_ms=step.exposed_ms + lazy_total,
            sample_ms=(t4 - step.t3) * 1e3,
            committed_tokens=committed,
            grammar_in_thread=step.in_thread,
            forbidden_rows=step.work.forbidden_rows,
            early_mask=step.work.masked_rows is not None,
            lazy_requests=len(step.lazy),
            proposed_nodes=step.proposed_nodes,
            forward_rows=step.rows,
            predicted_ms=step.predicted_ms,
        )

    def _device_masks(
        self,
        work: GrammarWork,
        logits: torch.Tensor,
        live: Sequence[RequestState],
        trees: Sequence[DraftTree],
        greedy: Sequence[bool],
        launched_at: float | None,
    ) -> None:
        """Start the step's device-side masking, if any, right after its grammar work:
        sampled grammar requests need the bitmask on the device (their per-request path masks
        there); an all-greedy step queues the masked argmax of every grammar row now when the
        graph replay started at ``launched_at`` leaves enough GPU time (:class:`.EarlyMask`),
        else its verifier masks only the rows it needs, after the forward. (On the CPU the
        "upload" is the host bitmask itself and no forward time is ever measured.)"""
        if not all(g for st, g in zip(live, greedy) if st.matcher is not None):
            work.device_bitmask = self._bitmasks.upload(work.bitmask, logits.device)
        elif launched_at is not None and self._early_mask.worth_it(
            (time.perf_counter() - launched_at) * 1e3
        ):
            t0 = time.perf_counter()
            work.device_bitmask = self._bitmasks.upload(work.bitmask, logits.device)
            offsets = [work.offsets.get(st.rid) for st in live]
            work.masked_rows = launch_masked_rows(logits, work.device_bitmask, trees, offsets)
            self._early_mask.record_launch((time.perf_counter() - t0) * 1e3)

    @staticmethod
    def _apply_errors(work: GrammarWork, draining: Sequence[RequestState], now: float) -> None:
        for st in draining:
            if st.rid in work.errors:
                st.finish("error", st.end_s or now, work.errors[st.rid])

    def _verify_batch(
        self,
        live: Sequence[RequestState],
        trees: Sequence[DraftTree],
        logits: torch.Tensor,
        top: torch.Tensor | None,
        greedy: Sequence[bool],
        work: GrammarWork,
        lazy: Collection[str],
    ) -> tuple[dict, dict[str, float]]:
        """Greedy verification of every eligible request at once (``greedy``): the forward's
        greedy tokens (``top``, from its graph) read back once, masked on the device only where
        a grammar forbids them (:mod:`.batch_verify`); requests in ``lazy`` walk with their
        matchers. Returns the verified walks by batch index and the lazy walks' grammar
        milliseconds by request id."""
        requests = [
            GreedyRequest(
                i,
                offset=work.offsets.get(st.rid),
                valid=work.valid.get(st.rid),
                stop_token_ids=self._stops_of(st),
                matcher=st.matcher if st.rid in lazy else None,
                pre_accepted=work.pre_accepted.get(st.rid, ()),
            )
            for i, st in enumerate(live)
            if st.rid not in work.errors and greedy[i]
        ]
        verified, stats = verify_greedy_batch(
            logits,
            trees,
            requests,
            bitmask=work.bitmask,
            row_argmax=top,
            masked_rows=work.masked_rows,
        )
        if work.offsets and requests:
            self._early_mask.record_verify(stats.forbidden_rows > 0)
        work.forbidden_rows = stats.forbidden_rows
        return verified, {live[i].rid: ms for i, ms in stats.lazy_ms.items()}

    def _stops_of(self, st: RequestState) -> Collection[int]:
        """The tokens that end ``st``: none for a plain request ignoring EOS."""
        return () if st.sampling.ignore_eos and st.matcher is None else self.stop_token_ids

    def _accept(
        self,
        st: RequestState,
        tree: DraftTree,
        logits: torch.Tensor,
        work: GrammarWork,
        verified: Any = None,
        *,
        fed: bool = False,
    ) -> int:
        """Verify (unless ``verified``), truncate and commit one request; returns the tokens
        committed. ``verified``: this request's result from :meth:`_verify_batch`, if it took
        part; ``fed``: its lazy walk has already fed the run to the matcher. Raises the
        :class:`SpecGrammarError` of a request whose grammar left nothing to sample."""
        if isinstance(verified, SpecGrammarError):
            raise verified
        stops = self._stops_of(st)
        nodes, bonus = (
            verified if verified is not None else self._verify_one(st, tree, logits, work)
        )
        if self._budget is not None:
            self._budget.record_accept(st.rid, tree, nodes)
        run = [tree.token_list[n] for n in nodes[1:]] + [int(bonus)]
        kept = self._append_run(st, run, stops, fed)
        if st.finished:
            self._release(st)
        else:
            self.runner.commit(st.rid, nodes)
        return kept

    def _verify_one(
        self, st: RequestState, tree: DraftTree, logits: torch.Tensor, work: GrammarWork
    ) -> tuple[list[int], int]:
        """The per-request path: ``logits`` ``(N, V)`` processed (penalties, token bitmask,
        temperature: :func:`process_tree_logits`) then :func:`~.verify.verify`. Returns the
        accepted nodes (root first) and the bonus token."""
        bitmask = valid = None
        if st.matcher is not None:
            off = work.offsets[st.rid]
            rows = work.device_bitmask if work.device_bitmask is not None else work.bitmask
            bitmask = rows[off : off + tree.num_nodes]
            valid = work.valid[st.rid]
        params = st.sampling
        processed = process_tree_logits(
            logits, tree, st.committed_ids, params, bitmask=bitmask, prompt_len=len(st.prompt_ids)
        )
        return verify(
            processed, tree, params, st.generator, valid, stop_token_ids=self._stops_of(st)
        )

    def _append_run(
        self, st: RequestState, run: Sequence[int], stops: Collection[int], fed: bool
    ) -> int:
        """Append the committed run (accepted path tokens + bonus) to ``st``'s output,
        truncated at a stop token (the request ends: ``grammar`` with a grammar, else
        ``eos``), a stop string or ``max_new_tokens``; the tokens go to the matcher's pending
        list unless ``fed``. Returns the tokens appended."""
        now = time.perf_counter()
        kept = 0
        for tok in run:
            if tok in stops:
                if st.matcher is not None and not fed:
                    st.pending.append(tok)  # the matcher sees its own termination
                st.finish("grammar" if st.matcher is not None else "eos", now)
                break
            st.output_ids.append(tok)
            if st.matcher is not None and not fed:
                st.pending.append(tok)
            kept += 1
            if st.sampling.stop and self._hit_stop_string(st):
                st.finish("stop_string", now)
                break
            if len(st.output_ids) >= st.sampling.max_new_tokens:
                st.finish("length", now)
                break
        return kept

    def _hit_stop_string(self, st: RequestState) -> bool:
        text = self.tokenizer.decode(st.output_ids)
        return any(s and s in text for s in st.sampling.stop)

    def _split_reasoning(self, st: RequestState, text: str) -> tuple[str | None, str]:
        """(reasoning text without the marker, the text after it) of a request with
        ``reasoning_end`` (all of ``text`` is reasoning when the marker never came); (None,
        ``text``) otherwise or for a bad marker (the request already ended with its error)."""
        end = st.request.reasoning_end
        if end is None:
            return None, text
        info = self.backend.tokenizer_info if self.backend is not None else self._token_info()
        try:
            marker, _ = resolve_marker(info, end)
        except SpecGrammarError:
            return None, text
        k = reasoning_token_count(info, st.output_ids, marker)
        if k is None:
            return text, ""
        head = self.tokenizer.decode(st.output_ids[:k])
        return head.removesuffix(marker.decode("utf-8", "replace")), text[len(head) :]

    @staticmethod
    def _tool_calls(st: RequestState, text: str) -> tuple[str | None, list[dict] | None]:
        """(message content, parsed calls) of a tool-call request its grammar completed;
        (None, None) for any other (no calls: None)."""
        spec = st.request.grammar
        if not isinstance(spec, ToolCalls) or st.finish_reason != "grammar":
            return None, None
        try:
            content, calls = parse_tool_calls(text, spec)
        except ValueError:  # a grammar's document always parses; never fail the result on it
            return None, None
        return content, calls or None

    def _token_info(self) -> TokenizerInfo:
        if self._plain_token_info is None:
            self._plain_token_info = TokenizerInfo.from_huggingface(self.tokenizer)
        return self._plain_token_info

    def _release(self, st: RequestState) -> None:
        if st.rid in self.runner.request_ids:
            self.runner.remove(st.rid)
            self.drafter.remove(st.rid)
        if self._budget is not None:
            self._budget.forget(st.rid)

    def result(self, st: RequestState) -> RequestResult:
        """The :class:`RequestResult` of request state ``st`` as it stands (what :meth:`run`
        returns for it once it ended): its output checked against its request (``valid``)
        where it completed. A :class:`~.streaming.TextStream` reads it for a request's last
        chunk, which ends before the run does."""
        reasoning, text = self._split_reasoning(st, committed_text(self.tokenizer, st))
        content, calls = self._tool_calls(st, text)
        n = len(st.output_ids)
        wall = max(st.end_s - st.start_s, 1e-9)
        detail = st.finish_reason or "error"
        valid, violations = None, []
        if detail in COMPLETED_DETAILS and st.request.grammar is not None:
            valid, violations = check_output(st.request.grammar, text)
        return RequestResult(
            rid=st.rid if isinstance(st.rid, str) else repr(st.rid),  # a bad id ended the request
            text=text,
            token_ids=list(st.output_ids),
            prompt_tokens=len(st.prompt_ids),
            reasoning_text=reasoning,
            content=content,
            tool_calls=calls,
            finish_reason=finish_reason_of(detail, st.request.grammar, text),
            finish_detail="violation" if valid is False else detail,
            error=st.error,
            num_tokens=n,
            steps=st.steps,
            accept_length=n / st.steps if st.steps else 0.0,
            tokens_per_s=n / wall if n else 0.0,
            grammar_ms_hidden=st.grammar_ms - st.grammar_exposed_ms,
            grammar_ms_exposed=st.grammar_exposed_ms,
            warnings=list(st.warnings),
            valid=valid,
            violations=violations,
            backend=st.backend_name,
            backend_reason=st.backend_reason,
        )
