"""Mask-apply and fused-verify kernels against the memory-bandwidth bound and other libraries.

GPU (default when CUDA is available): for rows x vocab x dtype, times spec-grammar's apply,
xgrammar's ``apply_token_bitmask_inplace`` with ``backend="cuda"`` (its CUDA C++ kernel) and
``backend="triton"``, and ``llguidance.torch.apply_token_bitmask_inplace``, in the same run;
unless ``--apply-only``, also the fused masked argmax / softmax against apply followed by
``torch.argmax`` / ``torch.softmax``.

Every call reads cold memory: each candidate gets enough distinct input sets to span 4x the L2,
and its calls go round them. Two times per call:

* graph replay: the calls (one per set) captured back to back in one CUDA graph; after 50 ms of
  warm-up replays, the median of 20 replays (CUDA events) over the number of sets. Device time
  only.
* eager: the same calls launched eagerly back to back from Python, as an engine calls the apply
  once per step outside its CUDA graphs; after 50 ms of warm-up loops, the median of 30 loops
  (CUDA events around each loop) over the number of sets, the candidates' loops alternating.
  Where a call's host time (argument checks, launch) exceeds its device time, this is the host
  time.

Also recorded: the host time of one launch (``launch_us``: wall time of 2,000 back-to-back
calls on a one-row input over 2,000, median of 5 alternating rounds) and, with ``--sweep``,
the apply time of several Triton block configurations per shape (how the defaults were
chosen).

Bound of the in-place apply: one read and one write of the logits plus one read of the mask,
over the device-to-device copy bandwidth measured in the same run (bytes read + written by an
eager 1 GiB ``copy_``; captured in a graph, a copy becomes a copy-engine node, about 35%
slower). Every cell also checks the results: spec-grammar's apply equals its torch path and
the other libraries' results bit for bit, the fused argmax equals apply + argmax, and the fused
softmax is close to apply + softmax.

CPU (``--device cpu``, smaller sizes): wall-clock medians of the same calls, with xgrammar's
``cpu`` backend and llguidance's torch apply (``torch.compile``; compiled before timing).

Masks: ``random`` draws every bit independently with p = 1/2 (every 32-token word is mixed, so
the whole row must be read and written: the bound case); ``sparse`` allows about 1% of the
tokens in runs, as grammar masks at structural positions do (most words all zero).

Writes ``<out>/kernels-<tag>.json`` and ``<out>/kernels-<tag>.md``.

    python benchmarks/bench_kernels.py --out benchmarks/results --tag h200
    python benchmarks/bench_kernels.py --device cpu --tag cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings

import torch
from spec_grammar_bench.kernels_report import APPLY, FUSED, render_kernels_markdown
from spec_grammar_bench.peers import library_version, mask_apply_functions
from spec_grammar_bench.report import write_report

from spec_grammar.kernels import apply_token_bitmask_inplace, masked_argmax, masked_softmax
from spec_grammar.kernels.cpu import apply_token_bitmask_inplace_torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GPU_ROWS, GPU_VOCABS = (64, 512, 2048), (49_152, 128_256, 262_144)
CPU_ROWS, CPU_VOCABS = (1, 16, 64), (49_152, 262_144)
TEMPERATURE = 0.8


def make_mask(kind: str, rows: int, vocab: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """``(rows, ceil(vocab/32))`` int32 mask of the given kind (see the module docstring)."""
    width = (vocab + 31) // 32
    if kind == "random":
        m = torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32, generator=gen)
        return m.to(device)
    # sparse: ~1% of the words are all ones, plus one random bit in another ~1%.
    full = torch.rand(rows, width, generator=gen) < 0.01
    single = torch.rand(rows, width, generator=gen) < 0.01
    bit = torch.randint(0, 31, (rows, width), generator=gen, dtype=torch.int32)
    m = torch.where(single, torch.ones_like(bit) << bit, torch.zeros_like(bit))
    m = torch.where(full, torch.full_like(m, -1), m)
    return m.to(device)


# ----------------------------------------------------------------------------- GPU


def eager_time_ms(fn) -> float:
    """``do_bench`` median with the L2 flushed before each call (the copy bandwidth, and
    calls that cannot be captured in a graph)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _warm(run) -> None:
    """50 ms of ``run`` + synchronize, so clocks have ramped after the host-side setup."""
    warm = time.perf_counter()
    while time.perf_counter() - warm < 0.05:
        run()
        torch.cuda.synchronize()


def _median_event_ms(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(calls: list, replays: int = 20) -> float:
    """Device time of one call: ``calls`` (one closure per buffer set) are captured back to
    back in one CUDA graph; after 50 ms of warm-up replays, the median replay time (CUDA
    events) / ``len(calls)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / autotune outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    _warm(graph.replay)
    ms = _median_event_ms(graph.replay, replays)
    del graph
    return ms / len(calls)


def eager_loop_times_ms(calls: dict[str, list], loops: int = 30) -> dict[str, float]:
    """Time of one eager call on cold memory, per candidate: each candidate's ``calls`` (one
    closure per buffer set) launched back to back from Python; after 50 ms of warm-up loops,
    the median loop time (CUDA events around each loop) / number of calls. The candidates'
    loops alternate, so host-speed drift hits them alike. The host's launch time shows where
    it exceeds the device time."""

    def loop(fns):
        for fn in fns:
            fn()

    for fns in calls.values():
        _warm(lambda fns=fns: loop(fns))
    times = {name: [] for name in calls}
    for _ in range(loops):
        for name, fns in calls.items():
            times[name].append(_median_event_ms(lambda fns=fns: loop(fns), 1) / len(fns))
    return {name: statistics.median(ts) for name, ts in times.items()}


def launch_us(fn, calls: int = 2000) -> float:
    """Host microseconds per call: ``calls`` back-to-back calls of ``fn`` (a one-row input, so
    the device keeps up) timed on the wall clock, then one synchronize."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def launch_overheads(others: dict, gen: torch.Generator, rounds: int = 5) -> dict:
    """Median over ``rounds`` alternating rounds of :func:`launch_us` of every apply on a
    ``(1, 4096)`` float32 input; ours also through Triton's JIT launch (the path before the
    cached launch, for comparison)."""
    from spec_grammar.kernels import triton as ours_triton

    logits = torch.randn(1, 4096, device="cuda")
    mask = make_mask("random", 1, 4096, "cuda", gen)

    def jit_launch():
        cached, ours_triton._CACHED_LAUNCH = ours_triton._CACHED_LAUNCH, False
        ours_triton._CACHE.clear()
        try:
            return launch_us(lambda: apply_token_bitmask_inplace(logits, mask))
        finally:
            ours_triton._CACHED_LAUNCH = cached

    timers = {
        APPLY: lambda: launch_us(lambda: apply_token_bitmask_inplace(logits, mask)),
        **{n: (lambda fn=fn: launch_us(lambda: fn(logits, mask))) for n, fn in others.items()},
        APPLY + " (JIT launch)": jit_launch,
    }
    got = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            got[name].append(timer())
    return {name: statistics.median(ts) for name, ts in got.items()}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written: eager
    ``copy_`` of 1 GiB (a copy captured in a graph becomes a copy-engine node, about 35% slower)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = eager_time_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


def buffer_sets(bytes_per_set: int) -> int:
    """Distinct input sets per graph so that they span 4x the L2 (every call starts cold)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(64, -(-4 * l2 // bytes_per_set)))


def gpu_cell(rows, vocab, dname, kind, others, bw, gen, apply_only: bool) -> dict:
    dtype = DTYPES[dname]
    logits0 = torch.randn(rows, vocab, device="cuda", dtype=torch.float32).to(dtype)
    mask0 = make_mask(kind, rows, vocab, "cuda", gen)
    width = mask0.shape[1]
    bound_bytes = 2 * rows * vocab * logits0.element_size() + rows * width * 4
    bound_ms = bound_bytes / bw * 1e3

    # Correctness on this cell's data.
    ours = logits0.clone()
    apply_token_bitmask_inplace(ours, mask0)
    ref = logits0.clone()
    apply_token_bitmask_inplace_torch(ref, mask0)
    checks = {"apply == torch path": bool(torch.equal(ours, ref))}
    for name, fn in others.items():
        theirs = logits0.clone()
        fn(theirs, mask0)
        checks[f"apply == {name}"] = bool(torch.equal(ours, theirs))
    if not apply_only:
        expect = ours.float().argmax(dim=1)
        expect[ours.float().amax(dim=1) == float("-inf")] = -1
        checks["masked_argmax == apply+argmax"] = bool(
            torch.equal(masked_argmax(logits0, mask0), expect)
        )
        probs = masked_softmax(logits0, mask0, TEMPERATURE)
        ref_p = torch.softmax(ours.float() / TEMPERATURE, dim=1)
        checks["masked_softmax ~= apply+softmax"] = bool(
            torch.allclose(probs, ref_p, rtol=1e-4, atol=1e-7)
        )
        del probs, ref_p
    del ref, ours

    k = buffer_sets(rows * vocab * logits0.element_size() + rows * width * 4)
    src = [logits0.clone() for _ in range(k)]
    work = [logits0.clone() for _ in range(k)]
    masks = [mask0.clone() for _ in range(k)]
    sets = list(zip(src, work, masks))

    def per_set(fn):
        return [lambda s=s, w=w, m=m: fn(s, w, m) for s, w, m in sets]

    applies = {
        APPLY: lambda s, w, m: apply_token_bitmask_inplace(w, m),
        **{name: (lambda s, w, m, fn=fn: fn(w, m)) for name, fn in others.items()},
    }
    fused = {
        "fused_argmax": lambda s, w, m: masked_argmax(s, m),
        "apply+argmax": lambda s, w, m: (apply_token_bitmask_inplace(w, m), torch.argmax(w, dim=1)),
        "fused_softmax": lambda s, w, m: masked_softmax(s, m, TEMPERATURE),
        "apply+softmax": lambda s, w, m: (
            apply_token_bitmask_inplace(w, m),
            torch.softmax(w.float() / TEMPERATURE, dim=1),
        ),
    }
    t, notes = {}, {}
    for name, fn in {**applies, **({} if apply_only else fused)}.items():
        try:
            t[name] = graph_time_ms(per_set(fn))
        except Exception as e:  # noqa: BLE001 - e.g. a library that cannot be captured
            notes[name] = f"not capturable ({type(e).__name__}: {str(e)[:120]}); eager time"
            torch.cuda.synchronize()
            t[name] = eager_time_ms(lambda fn=fn: fn(*sets[0]))
    eager = eager_loop_times_ms({name: per_set(fn) for name, fn in applies.items()})
    if not apply_only:
        eager.update(eager_loop_times_ms({n: per_set(fused[n]) for n in FUSED[:2]}))
    return {
        "rows": rows,
        "vocab": vocab,
        "dtype": dname,
        "mask": kind,
        "buffer_sets": k,
        "bound_bytes": bound_bytes,
        "bound_ms": bound_ms,
        "ms": t,
        "eager_ms": eager,
        "notes": notes,
        "achieved_GBps": bound_bytes / (t[APPLY] * 1e-3) / 1e9,
        "fraction_of_bound": bound_ms / t[APPLY],
        "checks": checks,
    }


SWEEP_BYTES, SWEEP_WARPS = (2048, 4096, 8192, 16384), (4, 8)


def sweep(gen, rows_list, vocabs) -> list[dict]:
    """Apply time (graph and eager) for (bytes of logits per program, warps) candidates at
    every rows x vocab x dtype: how the Triton defaults were chosen."""
    from spec_grammar.kernels.triton import apply_token_bitmask_inplace_triton

    out = []
    for dname, dtype in DTYPES.items():
        for rows in rows_list:
            for vocab in vocabs:
                logits = torch.randn(rows, vocab, device="cuda").to(dtype)
                mask = make_mask("random", rows, vocab, "cuda", gen)
                sets = [(logits.clone(), mask.clone()) for _ in range(buffer_sets(logits.nbytes))]
                for nbytes in SWEEP_BYTES:
                    words = nbytes // (32 * logits.element_size())
                    for warps in SWEEP_WARPS:
                        calls = [
                            lambda l=l, m=m: apply_token_bitmask_inplace_triton(
                                l, m, words_per_program=words, num_warps=warps
                            )
                            for l, m in sets
                        ]
                        row = {
                            "dtype": dname,
                            "rows": rows,
                            "vocab": vocab,
                            "bytes": nbytes,
                            "warps": warps,
                            "ms": graph_time_ms(calls),
                            "eager_ms": eager_loop_times_ms({"": calls})[""],
                        }
                        out.append(row)
                        print(
                            f"sweep {dname} {rows}x{vocab} bytes={nbytes} warps={warps}: "
                            f"{row['ms'] * 1e3:.1f} us graph, {row['eager_ms'] * 1e3:.1f} us eager",
                            flush=True,
                        )
                del logits, mask, sets
    return out


def run_gpu(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    others = mask_apply_functions("cuda")
    if args.apply_only:
        others.pop("llguidance", None)
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s", flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_bandwidth_Bps": bw,
        "launch_us": launch_overheads(others, gen),
        "cells": [],
    }
    print(json.dumps(result["launch_us"]), flush=True)
    for name in others:
        result[f"{name}_version"] = library_version(name)
    if args.sweep:
        result["sweep"] = sweep(gen, args.rows or (64, 512), args.vocabs or GPU_VOCABS)
    for kind in args.masks:
        for rows in args.rows or GPU_ROWS:
            for vocab in args.vocabs or GPU_VOCABS:
                for dname in DTYPES:
                    cell = gpu_cell(rows, vocab, dname, kind, others, bw, gen, args.apply_only)
                    result["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
    return result


# ----------------------------------------------------------------------------- CPU


def cpu_time_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def run_cpu(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    others = mask_apply_functions("cpu")
    result = {
        "device": f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cells": [],
    }
    for kind in args.masks:
        for rows in args.rows or CPU_ROWS:
            for vocab in args.vocabs or CPU_VOCABS:
                for dname, dtype in DTYPES.items():
                    logits0 = torch.randn(rows, vocab, generator=gen).to(dtype)
                    mask = make_mask(kind, rows, vocab, "cpu", gen)
                    ours = logits0.clone()
                    apply_token_bitmask_inplace(ours, mask)
                    checks = {}
                    for name, fn in others.items():
                        theirs = logits0.clone()
                        fn(theirs, mask)  # also compiles llguidance's kernel before timing
                        checks[f"apply == {name}"] = bool(torch.equal(ours, theirs))
                    reps = max(5, min(200, int(2e7 // (rows * vocab))))
                    work = logits0.clone()
                    t = {
                        "spec_grammar": cpu_time_ms(
                            lambda: apply_token_bitmask_inplace(work, mask), reps
                        )
                    }
                    for name, fn in others.items():
                        t[name] = cpu_time_ms(lambda fn=fn: fn(work, mask), reps)
                    t["fused_argmax"] = cpu_time_ms(lambda: masked_argmax(logits0, mask), reps)
                    t["apply+argmax"] = cpu_time_ms(
                        lambda: (
                            apply_token_bitmask_inplace(work, mask),
                            torch.argmax(work, dim=1),
                        ),
                        reps,
                    )
                    cell = {
                        "rows": rows,
                        "vocab": vocab,
                        "dtype": dname,
                        "mask": kind,
                        "ms": t,
                        "checks": checks,
                    }
                    result["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None, help="file stem suffix (default: h200 on CUDA, cpu)")
    ap.add_argument(
        "--masks", nargs="+", default=["random", "sparse"], choices=("random", "sparse")
    )
    ap.add_argument("--rows", nargs="+", type=int, help="override the row counts")
    ap.add_argument("--vocabs", nargs="+", type=int, help="override the vocab sizes")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--sweep", action="store_true", help="GPU: also time Triton block configs")
    ap.add_argument(
        "--apply-only",
        action="store_true",
        help="GPU: time the apply only (ours and xgrammar's kernels; no fused verification)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    gpu = args.device == "cuda"
    result = run_gpu(args) if gpu else run_cpu(args)
    tag = args.tag or ("h200" if gpu else "cpu")
    result["kind"] = "kernels"
    md = "# spec-grammar benchmark: mask-apply kernels\n\n" + render_kernels_markdown(result)
    write_report(result, args.out, f"kernels-{tag}", md)
    print(md)


if __name__ == "__main__":
    main()
