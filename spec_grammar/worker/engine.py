"""The speculative worker: a batch loop of draft -> verify -> accept with grammar work
overlapped under the verify forward.

Per step (DESIGN.md section 4; SGLang's "Overlap grammar with speculative decode verify",
#31488, adapted to one CPU process):

1. **Draft**: one tree per live request (``Drafter.propose``), root = last committed token;
   trees deeper than the request's remaining token budget are cut.
2. **Verify forward**: ``ModelRunner.forward_trees`` over every node of every tree.
3. **Grammar work**, while step 2 runs when ``overlap=True`` (after it otherwise). On CUDA with
   graphs either inline once the replay returns, or in the grammar thread started right
   before the replay, whose host-side launch (0.3-1 ms on an H200) releases the GIL: whichever
   the measured times predict faster (:mod:`.placement`; a thread started before the input
   preparation fought it for the GIL and slowed the launch 2-5x). On CPU or eager CUDA in the
   grammar thread from the start of the step, since the forward call itself keeps the calling
   thread busy. Every matcher is first advanced with the tokens the PREVIOUS step committed
   (each committed token reaches its matcher exactly once; a finished request's last run is
   fed too), then the tree rows of this step are filled (``GrammarBackend.fill_tree_bitmasks``).
   Advance-then-fill is forced by the tree semantics: row n is the allowed set after
   committed + path root..n, so the matcher must hold every committed token first. With
   ``grammar_threads > 1`` the requests are split into contiguous groups of about equal node
   count and each group's advance + fill runs in its own thread, into its own rows of the
   step's host bitmask (a reused buffer of :class:`~.host_bitmask.HostBitmaskRing`).
4. **Accept**: greedy requests without penalties all at once: the forward's greedy token of
   every row (computed in its CUDA graph) is read back once and checked against one word of the
   host bitmask; only rows whose grammar forbids it are masked on the device
   (:mod:`.batch_verify`), or all grammar rows early while the forward runs where that pays
   (:class:`~.placement.EarlyMask`). Greedy grammar requests may also skip the tree fill
   (*lazy* verification, :class:`~.placement.LazyGrammar`): their walks ask the matcher to
   accept each greedy token they read and fill only a row whose greedy token it refuses, which
   pays where a step's tree fills would not hide under its forward. Other requests:
   ``process_tree_logits`` (penalties, grammar mask, temperature) then ``verify_greedy`` /
   ``verify_stochastic``. The committed run
   (accepted path tokens + bonus) is truncated at a stop token (EOS / grammar completion), a
   stop string or ``max_new_tokens``; unfinished requests ``commit`` the accepted path.

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
from typing import Any

import torch

from ..errors import SpecGrammarError
from ..protocol import GrammarBackend
from ..tree import DraftTree
from .batch_verify import (
    batch_greedy_eligible,
    launch_masked_rows,
    pre_accept_first_branch,
    verify_greedy_batch,
)
from .drafters import Drafter, NoDrafter
from .drafters.constrained import make_grammar_drafter
from .host_bitmask import HostBitmaskRing
from .placement import EarlyMask, GrammarPlacement, LazyGrammar
from .request import Request, RequestError, RequestResult, RequestState, StepStats, check_request
from .runner import ModelRunner
from .sampling import SamplingParams, make_generator, process_tree_logits
from .verify import verify

__all__ = ["SpecWorker", "cut_tree_depth", "split_balanced"]


def cut_tree_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without the nodes deeper than ``max_depth`` (node order kept)."""
    depth = tree.depth_list
    if max(depth) <= max_depth:
        return tree
    keep = [i for i in range(tree.num_nodes) if depth[i] <= max_depth]
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        [tree.token_list[i] for i in keep],
        [-1 if i == 0 else index[tree.parent_list[i]] for i in keep],
    )


def split_balanced(weights: Sequence[int], parts: int) -> list[range]:
    """Split ``range(len(weights))`` into ``min(parts, len(weights))`` contiguous, non-empty
    ranges whose weight sums are about equal: boundary k sits where the running sum comes
    closest to ``k / parts`` of the total. Order is kept, so the ranges are also contiguous
    row ranges of a bitmask filled in request order. Returns ``[]`` for no weights."""
    n = len(weights)
    parts = min(parts, n)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    bounds = [0]
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        # leave at least one item for this range and for each range after it
        bounds.append(
            min(range(bounds[-1] + 1, n - parts + k + 1), key=lambda j: abs(prefix[j] - target))
        )
    bounds.append(n)
    return [range(a, b) for a, b in itertools.pairwise(bounds)] if n else []


class _GrammarWork:
    """What the grammar work of one step (or of one group of its requests) hands back."""

    __slots__ = (
        "bitmask",
        "device_bitmask",
        "masked_rows",
        "forbidden_rows",
        "offsets",
        "valid",
        "errors",
        "ms",
        "per_request_ms",
        "pre_accepted",
    )

    def __init__(self) -> None:
        self.bitmask: torch.Tensor | None = None
        self.device_bitmask: torch.Tensor | None = None  # ``bitmask`` on the logits' device
        self.masked_rows: torch.Tensor | None = None  # masked argmax of its rows, queued early
        self.forbidden_rows = 0  # visited rows whose grammar forbade the greedy token
        self.offsets: dict[str, int] = {}
        self.valid: dict[str, torch.Tensor] = {}
        self.errors: dict[str, str] = {}
        self.ms = 0.0
        self.per_request_ms: dict[str, float] = {}
        self.pre_accepted: dict[str, list[int]] = {}  # lazy requests: first-branch nodes accepted


class SpecWorker:
    """Runs batches of requests with tree speculative decoding and grammar constraints.

    Args:
        model: a ``transformers`` causal LM (the target), or a ready
            :class:`~spec_grammar.worker.runner.ModelRunner` over it.
        tokenizer: its Hugging Face tokenizer.
        backend: a :class:`~spec_grammar.protocol.GrammarBackend` built for this tokenizer
            with ``vocab_size`` = the model's logits width, a registered backend name, or
            None (then only plain requests are allowed; a grammar request fails alone).
        draft: a :class:`~spec_grammar.worker.drafters.Drafter` or a name (``ngram``,
            ``self:L``, ``model:PATH``, ``none``); see
            :func:`~spec_grammar.worker.drafters.make_drafter`.
        topk / num_steps / num_draft_tokens: tree shape (model drafters use all three; the
            n-gram drafter uses ``num_draft_tokens``, the node cap root included).
        no_spec: plain constrained decoding (root-only trees) through the same code path.
        overlap: do the grammar work while the verify forward runs (in a worker thread; with
            CUDA graphs inline after the replay or in the thread during it, as measured
            fastest). ``False``: strictly in order (on CUDA the forward is waited for first).
        constrain_draft: grammar-constrained drafting: only legal tokens enter the tree and
            the rows computed while drafting are reused for verification
            (:mod:`~spec_grammar.worker.drafters.constrained`); ``draft="grammar"`` drafts
            forced tokens alone.
        forced_tokens: extend draft branches with grammar-forced tokens
            (:mod:`~spec_grammar.worker.drafters.forced`). Off here so that a
            :class:`Drafter` instance passed in runs exactly as given; ``generate`` and the
            CLI default to :data:`~spec_grammar.worker.drafters.constrained.DEFAULT_FORCED_TOKENS`.
        device: where the target runs (default: the model's device).
        cuda_graphs: passed to :class:`~spec_grammar.worker.runner.ModelRunner` (CUDA graphs
            are used on CUDA devices only; None = the runner's default).
        fused_forward: passed to the runner too: our fused decoder for Llama-family models
            (:mod:`~spec_grammar.worker.decoder`; None = on for CUDA with Triton where supported).
        grammar_threads: threads sharing a step's grammar work (advance + tree fill), each
            taking a contiguous group of requests; None = 1. Outputs do not depend on it.
            More threads pay only where the backend's own native work dominates a fill (its
            GIL-free part): with xgrammar on a 16-core H200 host, 8 threads were up to 2.5x
            slower than one for 8-16-node trees (7.1 vs 2.8 ms at 8 requests x 8 nodes) and
            faster only for 64-node trees whose fills were inflated by padding ids (since
            fixed); a second thread was 0.76x on 2 cores
            (``benchmarks/results/grammar-threads-h200.md``). Raises ``ValueError`` unless None
            or an int >= 1.
        lazy_grammar: verify greedy grammar requests lazily, without tree fills (each walk
            asks the matcher for the greedy tokens it reads; :class:`~.placement.LazyGrammar`).
            None (default): on CUDA-graph steps with overlap, whenever the measured fill time
            would not hide under the forward; True: always; False: never. Outputs do not depend
            on it. Raises ``ValueError`` unless None or a bool.

    Stats: :attr:`step_stats` holds one :class:`StepStats` per step of the last :meth:`run`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        backend: GrammarBackend | str | None = "xgrammar",
        draft: Drafter | str | None = "ngram",
        topk: int = 1,
        num_steps: int = 4,
        num_draft_tokens: int = 8,
        no_spec: bool = False,
        overlap: bool = True,
        device: Any = None,
        constrain_draft: bool = False,
        forced_tokens: bool = False,
        cuda_graphs: bool | None = None,
        grammar_threads: int | None = None,
        fused_forward: bool | None = None,
        lazy_grammar: bool | None = None,
    ):
        if grammar_threads is not None and (
            isinstance(grammar_threads, bool)
            or not isinstance(grammar_threads, int)
            or grammar_threads < 1
        ):
            raise ValueError(
                f"grammar_threads must be None or an int >= 1, got {grammar_threads!r}"
            )
        if lazy_grammar is not None and not isinstance(lazy_grammar, bool):
            raise ValueError(f"lazy_grammar must be None, True or False, got {lazy_grammar!r}")
        self.runner = (
            model
            if isinstance(model, ModelRunner)
            else ModelRunner(
                model, device=device, cuda_graphs=cuda_graphs, fused_forward=fused_forward
            )
        )
        self.tokenizer = tokenizer
        if isinstance(backend, str):
            from ..registry import get_backend

            backend = get_backend(backend, tokenizer, vocab_size=self.runner.vocab_size)
        if backend is not None and backend.vocab_size != self.runner.vocab_size:
            raise ValueError(
                f"the grammar backend masks {backend.vocab_size} logits but the model has "
                f"{self.runner.vocab_size}; build it with vocab_size={self.runner.vocab_size}"
            )
        self.backend = backend
        self.drafter = (
            NoDrafter()
            if no_spec
            else make_grammar_drafter(
                draft,
                constrain_draft=constrain_draft,
                forced_tokens=forced_tokens,
                target_model=self.runner.model,
                device=self.runner.device,
                cuda_graphs=cuda_graphs,
                fused_forward=fused_forward,
                topk=topk,
                num_steps=num_steps,
                num_draft_tokens=num_draft_tokens,
            )
        )
        self.no_spec = no_spec
        self.overlap = overlap
        if backend is not None:
            stops = backend.tokenizer_info.stop_token_ids
        else:
            eos = tokenizer.eos_token_id
            stops = (eos,) if isinstance(eos, int) else tuple(eos)
        self.stop_token_ids = frozenset(int(t) for t in stops)
        self.step_stats: list[StepStats] = []
        self.grammar_threads = grammar_threads or 1
        self._placement = GrammarPlacement()
        self._early_mask = EarlyMask()
        self.lazy_grammar = lazy_grammar
        self._lazy = LazyGrammar()
        self._pool: ThreadPoolExecutor | None = None
        self._group_pool: ThreadPoolExecutor | None = None
        self._open_pools()
        self._bitmasks = (
            HostBitmaskRing(backend.vocab_size, pin=self.runner.device.type == "cuda")
            if backend is not None
            else None
        )
        self._cancel_lock = threading.Lock()
        self._running: set[str] = set()
        self._cancelled: set[str] = set()

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
        if req.grammar is not None:
            if self.backend is None:
                st.finish(
                    "error", now, "this request has a grammar but the worker has no grammar backend"
                )
                return st
            try:
                compiled = self.backend.compile(req.grammar)
                st.matcher = self.backend.matcher(compiled)
                st.warnings = compiled.warnings
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
    def _grammar_work(
        self,
        live: Sequence[RequestState],
        trees: Sequence[DraftTree],
        draining: Sequence[RequestState],
        bitmask: torch.Tensor | None,
        lazy: Collection[str] = (),
    ) -> _GrammarWork:
        """Advance + fill for the whole step: request groups in parallel (this thread takes
        the first), merged in request order. ``bitmask``: ``(rows, W)`` int32 host buffer with
        one row per node of every live grammar request not in ``lazy`` (ids of requests
        verified lazily: advanced only), in request order."""
        t0 = time.perf_counter()
        entries: list[tuple[RequestState, DraftTree | None, int | None]] = [
            (st, None, 0) for st in draining
        ]
        rows = 0
        for st, tree in zip(live, trees):
            if st.rid in lazy:
                entries.append((st, tree, None))
            elif st.matcher is not None:
                entries.append((st, tree, rows))
                rows += tree.num_nodes
        # a draining request only accepts its last tokens: far cheaper than a tree fill
        groups = split_balanced(
            [1 if t is None else t.num_nodes for _, t, _ in entries], self.grammar_threads
        )
        parts = [entries[g.start : g.stop] for g in groups]
        if len(parts) <= 1:
            done = [self._group_work(parts[0] if parts else [], bitmask)]
        else:
            futs = [self._group_pool.submit(self._group_work, p, bitmask) for p in parts[1:]]
            try:
                first = self._group_work(parts[0], bitmask)
            finally:
                wait(futs)  # no group may still write the bitmask once this returns or raises
            done = [first] + [f.result() for f in futs]
        work = _GrammarWork()
        work.bitmask = bitmask
        for part in done:
            work.offsets.update(part.offsets)
            work.valid.update(part.valid)
            work.errors.update(part.errors)
            work.per_request_ms.update(part.per_request_ms)
            work.pre_accepted.update(part.pre_accepted)
        work.ms = (time.perf_counter() - t0) * 1e3
        return work

    def _group_work(
        self,
        entries: Sequence[tuple[RequestState, DraftTree | None, int | None]],
        bitmask: torch.Tensor | None,
    ) -> _GrammarWork:
        """Advance + fill of one contiguous group of requests: ``(state, tree, first row)``
        with ``tree`` None for a finished request that only takes its last tokens, and first
        row None for a request verified lazily (advanced, then its tree's first branch
        pre-accepted: :func:`.batch_verify.pre_accept_first_branch`). One
        ``fill_tree_bitmasks`` call for the group; if it raises, each request is filled alone
        so that only the failing one ends."""
        work = _GrammarWork()
        work.bitmask = bitmask
        jobs, owners, filled = [], [], 0
        for st, tree, off in entries:
            ts = time.perf_counter()
            ok = self._advance(st, work)
            work.per_request_ms[st.rid] = (time.perf_counter() - ts) * 1e3
            if tree is None or not ok:
                continue
            try:
                terminated = st.matcher.is_terminated()
                if off is None and not terminated:
                    work.pre_accepted[st.rid] = pre_accept_first_branch(st.matcher, tree)
                    work.per_request_ms[st.rid] = (time.perf_counter() - ts) * 1e3
                    continue
                drafted = None if terminated else self._drafted_rows(st, tree)
            except Exception as e:  # a grammar fault ends this request only
                work.errors[st.rid] = (
                    f"the grammar failed while checking its state: {type(e).__name__}: {e}"
                )
                continue
            if terminated:
                work.errors[st.rid] = "the grammar terminated without a stop token being committed"
                continue
            if drafted is not None:
                # rows the grammar-aware drafter computed while drafting are the verification rows
                drafted_rows, valid = drafted
                bitmask[off : off + drafted_rows.shape[0]] = drafted_rows
                work.valid[st.rid] = valid
            else:
                jobs.append((st.matcher, tree, off))
                owners.append(st)
                filled += tree.num_nodes
            work.offsets[st.rid] = off
        if jobs:
            tf = time.perf_counter()
            try:
                valids = self.backend.fill_tree_bitmasks(jobs, bitmask)
            except Exception:  # find the failing request(s): fill each alone
                valids = [self._fill_one(st, job, work) for st, job in zip(owners, jobs)]
            fill_ms = (time.perf_counter() - tf) * 1e3
            for st, (_, tree, _), valid in zip(owners, jobs, valids):
                if valid is None:
                    del work.offsets[st.rid]
                    continue
                work.valid[st.rid] = valid
                # a batched fill is timed as a whole: charge it by node count
                work.per_request_ms[st.rid] += fill_ms * tree.num_nodes / filled
        return work

    def _advance_before_draft(
        self, live: Sequence[RequestState], draining: Sequence[RequestState]
    ) -> list[RequestState]:
        """Feed every matcher the previous step's committed tokens BEFORE drafting (a
        grammar-aware drafter drafts from the matcher's current state), instead of under the
        verify forward; the time counts as exposed grammar time. Returns the live requests
        still running (a refused token ends its request with an error)."""
        work = _GrammarWork()
        for st in list(draining) + list(live):
            if st.matcher is None:
                continue
            ts = time.perf_counter()
            self._advance(st, work)
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

    @staticmethod
    def _advance(st: RequestState, work: _GrammarWork) -> bool:
        """Feed the pending committed tokens to the matcher; False (and an error) if refused."""
        if not st.pending:
            return True
        pending, st.pending = st.pending, []
        try:
            n = st.matcher.accept_tokens(pending)
        except Exception as e:  # a grammar fault ends this request only
            work.errors[st.rid] = (
                f"the grammar failed while accepting committed tokens: {type(e).__name__}: {e}"
            )
            return False
        if n != len(pending):
            work.errors[st.rid] = (
                f"the grammar refused committed token {pending[n]} after {st.matcher.num_accepted} "
                "accepted tokens (a mask/verify mismatch)"
            )
            return False
        return True

    @staticmethod
    def _fill_one(st: RequestState, job: tuple, work: _GrammarWork) -> torch.Tensor | None:
        """One request's tree fill; None (and an error for that request) when it raises."""
        matcher, tree, offset = job
        try:
            return matcher.fill_tree_bitmask(tree, work.bitmask, offset)
        except Exception as e:
            work.errors[st.rid] = (
                f"the grammar failed while filling the tree bitmask: {type(e).__name__}: {e}"
            )
            return None

    def _drafted_rows(self, st: RequestState, tree: DraftTree):
        """``(rows, valid)`` of ``tree`` kept by a grammar-aware drafter, or None."""
        get = getattr(self.drafter, "draft_rows", None)
        return None if get is None else get(st.rid, tree)

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
            final = _GrammarWork()
            for st in draining:
                ts = time.perf_counter()
                self._advance(st, final)
                st.grammar_ms += (time.perf_counter() - ts) * 1e3
                st.grammar_exposed_ms += (time.perf_counter() - ts) * 1e3
            self._apply_errors(final, draining, time.perf_counter())
        finally:
            with self._cancel_lock:
                self._running, self._cancelled = set(), set()
            for st in live:
                self._release(st)
        return [self._result(s) for s in states]

    def _step(self, live: list[RequestState], draining: list[RequestState]) -> StepStats:
        t0 = time.perf_counter()
        if getattr(self.drafter, "needs_grammar_state", False):
            live = self._advance_before_draft(live, draining)
            draining = []
        trees: list[DraftTree] = []
        if live:
            live, trees = self._propose(live)
        if not live:
            self._advance_before_draft([], draining)  # the last tokens of requests that finished
            ms = (time.perf_counter() - t0) * 1e3
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
        trees = [
            cut_tree_depth(t, s.sampling.max_new_tokens - len(s.output_ids) - 1)
            for s, t in zip(live, trees)
        ]
        t1 = time.perf_counter()
        rids = [s.rid for s in live]
        greedy = [batch_greedy_eligible(st.sampling) for st in live]
        lazy = self._lazy_requests(live, trees, greedy)
        rows = sum(
            t.num_nodes for s, t in zip(live, trees) if s.matcher is not None and s.rid not in lazy
        )
        bitmask = self._bitmasks.acquire(rows) if rows else None
        try:
            return self._verify_step(live, trees, draining, bitmask, rids, greedy, lazy, t0, t1)
        finally:
            if bitmask is not None:
                # every upload from this buffer was queued on the current stream by now
                self._bitmasks.record_upload(self.runner.device)

    def _propose(self, live: list[RequestState]) -> tuple[list[RequestState], list[DraftTree]]:
        """The drafter's trees for ``live``. Drafting that raises (e.g. a grammar-aware
        drafter's matcher faulting) is retried one request at a time: a request whose own
        drafting raises ends with an error (its committed tokens kept), the others go on.
        Returns the requests still live and their trees."""
        try:
            return live, self.drafter.propose(live)
        except Exception:
            pass
        kept, trees = [], []
        for st in live:
            try:
                (tree,) = self.drafter.propose([st])
            except Exception as e:
                st.finish("error", time.perf_counter(), f"drafting failed: {type(e).__name__}: {e}")
                self._release(st)
                continue
            kept.append(st)
            trees.append(tree)
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

    def _verify_step(
        self,
        live: list[RequestState],
        trees: list[DraftTree],
        draining: list[RequestState],
        bitmask: torch.Tensor | None,
        rids: list[str],
        greedy: list[bool],
        lazy: frozenset[str],
        t0: float,
        t1: float,
    ) -> StepStats:
        """Verify forward (grammar work under it), then mask, verify and commit."""
        graph_overlap = self.overlap and self.runner.uses_cuda_graphs
        in_thread = False
        # the greedy tokens of every row come from the forward's graph (no argmax launch)
        with_argmax = any(greedy)
        if graph_overlap:
            # The grammar work runs inline after the graph replay returns, or in the grammar
            # thread started right before the replay (whose host-side launch releases the GIL;
            # a thread started before the input preparation fought it for the GIL), whichever
            # the measured times predict faster (:mod:`.placement`). With no replay (an eager
            # bucket) it runs inline after the launch while the GPU computes.
            # lazy requests are not counted: their work here (an advance and the first branch
            # pre-accepted) is a few accepts, cheaper inline than a thread's hand-off
            units = (
                (0 if bitmask is None else bitmask.shape[0])
                + len(draining)
                + sum(st.matcher is not None and st.rid not in lazy for st in live)
            )
            # (no pool: the caller closed the worker inside this run, e.g. from on_step)
            want_thread = units > 0 and self._pool is not None and self._placement.use_thread(units)
            started: list[Future] = []
            launched: list[float] = []

            def before_launch() -> None:
                launched.append(time.perf_counter())
                if want_thread:
                    started.append(
                        self._pool.submit(self._grammar_work, live, trees, draining, bitmask, lazy)
                    )

            try:
                out = self.runner.forward_trees(
                    rids, trees, before_launch=before_launch, with_argmax=with_argmax
                )
            except BaseException:
                wait(
                    started
                )  # the grammar work writes the bitmask: let it end before the buffer is reused
                raise
            t2 = time.perf_counter()
            in_thread = bool(started)
            if in_thread:
                work = started[0].result()
                # from the thread's start to this thread running again: both wake-ups count (on
                # a virtual machine a blocked thread can take a millisecond to run again)
                grammar_ms = (time.perf_counter() - launched[0]) * 1e3
            else:
                work = self._grammar_work(live, trees, draining, bitmask, lazy)
                grammar_ms = work.ms
            if launched and units:
                self._placement.record(in_thread, units, grammar_ms, (t2 - launched[0]) * 1e3)
        elif self._pool is not None:
            fut = self._pool.submit(self._grammar_work, live, trees, draining, bitmask, lazy)
            try:
                out = self.runner.forward_trees(rids, trees, with_argmax=with_argmax)
            except BaseException:
                wait(
                    [fut]
                )  # the grammar work writes the bitmask: let it end before the buffer is reused
                raise
            t2 = time.perf_counter()
            work = fut.result()
        else:
            out = self.runner.forward_trees(rids, trees, with_argmax=with_argmax)
            if (
                self.runner.device.type == "cuda"
            ):  # in order: the forward ends before the grammar work starts
                torch.cuda.current_stream(self.runner.device).synchronize()
            t2 = time.perf_counter()
            work = self._grammar_work(live, trees, draining, bitmask, lazy)
        logits, top = out if with_argmax else (out, None)
        if bitmask is not None:
            self._device_masks(
                work,
                logits,
                live,
                trees,
                greedy,
                launched[0] if graph_overlap and launched else None,
            )
        t3 = time.perf_counter()
        # the step's grammar bookkeeping before the verify's wait for the device
        exposed, gpu_ms = (t3 - t2) * 1e3, None
        if (
            graph_overlap and launched
        ):  # exposed: what the grammar work took beyond the GPU's forward
            gpu_ms = self.runner.last_forward_gpu_ms()
            # None: the forward still runs, so the grammar work ended under it
            exposed = 0.0 if gpu_ms is None else max(0.0, exposed - gpu_ms)
        frac = min(1.0, exposed / work.ms) if work.ms > 0 else 0.0
        for st in itertools.chain(live, draining):
            ms = work.per_request_ms.get(st.rid, 0.0)
            st.grammar_ms += ms
            st.grammar_exposed_ms += ms * frac
        self._apply_errors(work, draining, t3)
        verified, lazy_ms = self._verify_batch(live, trees, logits, top, greedy, work, lazy)
        lazy_total = sum(lazy_ms.values())
        for st in live:
            if st.rid in lazy_ms:  # the lazy walks' grammar work: after the forward, all exposed
                st.grammar_ms += lazy_ms[st.rid]
                st.grammar_exposed_ms += lazy_ms[st.rid]
        committed = 0
        for i, (st, tree) in enumerate(zip(live, trees)):
            st.steps += 1
            if st.rid in work.errors:
                st.finish("error", t3, work.errors[st.rid])
                self._release(st)
                continue
            try:
                committed += self._accept(
                    st, tree, logits[i, : tree.num_nodes], work, verified.get(i), fed=st.rid in lazy
                )
            except SpecGrammarError as e:  # e.g. a matcher left with no allowed token
                st.finish("error", time.perf_counter(), str(e))
                self._release(st)
        if (
            graph_overlap and launched and (bitmask is not None or lazy)
        ):  # the forward has ended by now
            gpu_ms = gpu_ms if gpu_ms is not None else self.runner.last_forward_gpu_ms()
            # one forward-time average serves both policies; a bad event reading (never seen)
            # must not raise here, after the step's tokens were committed
            if gpu_ms is not None and math.isfinite(gpu_ms) and gpu_ms >= 0:
                self._early_mask.record_forward(gpu_ms)
            if lazy:
                self._lazy.record_lazy(len(lazy_ms), lazy_total)
            elif bitmask is not None:
                self._lazy.record_fill(bitmask.shape[0], work.ms)
        t4 = time.perf_counter()
        return StepStats(
            batch_size=len(live),
            num_nodes=sum(t.num_nodes for t in trees),
            step_ms=(t4 - t0) * 1e3,
            draft_ms=(t1 - t0) * 1e3,
            verify_forward_ms=(t2 - t1) * 1e3,
            grammar_ms=work.ms + lazy_total,
            grammar_exposed_ms=exposed + lazy_total,
            sample_ms=(t4 - t3) * 1e3,
            committed_tokens=committed,
            grammar_in_thread=in_thread,
            forbidden_rows=work.forbidden_rows,
            early_mask=work.masked_rows is not None,
            lazy_requests=len(lazy),
        )

    def _device_masks(
        self,
        work: _GrammarWork,
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
    def _apply_errors(work: _GrammarWork, draining: Sequence[RequestState], now: float) -> None:
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
        work: _GrammarWork,
        lazy: Collection[str],
    ) -> tuple[dict, dict[str, float]]:
        """Greedy verification of every eligible request at once (``greedy``): the forward's
        greedy tokens (``top``, from its graph) read back once, masked on the device only where
        a grammar forbids them (:mod:`.batch_verify`); requests in ``lazy`` walk with their
        matchers. Returns the verified walks by batch index and the lazy walks' grammar
        milliseconds by request id."""
        selected = [i for i, st in enumerate(live) if st.rid not in work.errors and greedy[i]]
        stats: dict = {}
        verified = verify_greedy_batch(
            logits,
            trees,
            selected,
            bitmask=work.bitmask,
            offsets=[work.offsets.get(st.rid) for st in live],
            valids=[work.valid.get(st.rid) for st in live],
            stop_token_ids=[
                () if st.sampling.ignore_eos and st.matcher is None else self.stop_token_ids
                for st in live
            ],
            matchers=[st.matcher if st.rid in lazy else None for st in live],
            pre_accepted=[work.pre_accepted.get(st.rid, ()) for st in live],
            row_argmax=top,
            masked_rows=work.masked_rows,
            stats=stats,
        )
        if work.offsets and "forbidden_rows" in stats:
            self._early_mask.record_verify(stats["forbidden_rows"] > 0)
        work.forbidden_rows = stats.get("forbidden_rows", 0)
        return verified, {live[i].rid: ms for i, ms in stats.get("lazy_ms", {}).items()}

    def _accept(
        self,
        st: RequestState,
        tree: DraftTree,
        logits: torch.Tensor,
        work: _GrammarWork,
        verified: Any = None,
        *,
        fed: bool = False,
    ) -> int:
        """Mask, verify, truncate and commit one request; returns the tokens committed.
        ``verified``: this request's result from :meth:`_verify_batch`, if it took part;
        ``fed``: its lazy walk has already fed the run to the matcher."""
        params = st.sampling
        if isinstance(verified, SpecGrammarError):
            raise verified
        bitmask = valid = None
        if verified is None and st.matcher is not None:
            off = work.offsets[st.rid]
            rows = work.device_bitmask if work.device_bitmask is not None else work.bitmask
            bitmask = rows[off : off + tree.num_nodes]
            valid = work.valid[st.rid]
        stops = () if params.ignore_eos and st.matcher is None else self.stop_token_ids
        if verified is not None:
            nodes, bonus = verified
        else:
            processed = process_tree_logits(
                logits,
                tree,
                st.committed_ids,
                params,
                bitmask=bitmask,
                prompt_len=len(st.prompt_ids),
            )
            nodes, bonus = verify(
                processed, tree, params, st.generator, valid, stop_token_ids=stops
            )
        run = [tree.token_list[n] for n in nodes[1:]] + [int(bonus)]
        now = time.perf_counter()
        kept = 0
        for tok in run:
            if tok in stops:
                if st.matcher is not None and not fed:
                    st.pending.append(tok)  # the matcher sees its own termination
                st.finish("grammar" if st.matcher is not None else "stop", now)
                break
            st.output_ids.append(tok)
            if st.matcher is not None and not fed:
                st.pending.append(tok)
            kept += 1
            if params.stop and self._hit_stop_string(st):
                st.finish("stop", now)
                break
            if len(st.output_ids) >= params.max_new_tokens:
                st.finish("length", now)
                break
        if st.finished:
            self._release(st)
        else:
            self.runner.commit(st.rid, nodes)
        return kept

    def _hit_stop_string(self, st: RequestState) -> bool:
        text = self.tokenizer.decode(st.output_ids)
        return any(s and s in text for s in st.sampling.stop)

    def _release(self, st: RequestState) -> None:
        if st.rid in self.runner.request_ids:
            self.runner.remove(st.rid)
            self.drafter.remove(st.rid)

    def _result(self, st: RequestState) -> RequestResult:
        text = self.tokenizer.decode(st.output_ids)
        if st.finish_reason == "stop" and st.sampling.stop:
            cuts = [text.find(s) for s in st.sampling.stop if s and s in text]
            if cuts:
                text = text[: min(cuts)]
        n = len(st.output_ids)
        wall = max(st.end_s - st.start_s, 1e-9)
        return RequestResult(
            rid=st.rid if isinstance(st.rid, str) else repr(st.rid),  # a bad id ended the request
            text=text,
            token_ids=list(st.output_ids),
            prompt_tokens=len(st.prompt_ids),
            finish_reason=st.finish_reason or "error",
            error=st.error,
            num_tokens=n,
            steps=st.steps,
            accept_length=n / st.steps if st.steps else 0.0,
            tokens_per_s=n / wall if n else 0.0,
            grammar_ms_hidden=st.grammar_ms - st.grammar_exposed_ms,
            grammar_ms_exposed=st.grammar_exposed_ms,
            warnings=list(st.warnings),
        )
