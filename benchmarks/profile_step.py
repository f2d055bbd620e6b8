"""Where a speculative step's host time goes, one ``bench gpu`` configuration at a time.

For each ``--config MODEL:TOKENIZER:BATCH:NODES`` the bench's setup is built (random-weight
shape or real weights, replay drafter, document agreement), each ``--modes`` worker runs the
document ``--runs`` times after one untimed run, and this prints:

* the mean step phases (``StepStats``: draft, forward launch, grammar, verify + commit);
* the host functions with the most own time, then the project's functions by cumulative
  time (``cProfile`` over the timed runs), which names
  the host work on the critical path of an overlapped step (launch + grammar before the GPU's
  forward ends, verify + commit after it);
* modes: ``plain`` (no grammar), ``overlap`` (grammar + overlap, fill or lazy verification as
  the worker picks), ``fill`` / ``lazy`` (overlap with tree fills only / lazy verification only),
  ``sync`` (grammar, no overlap);
* with ``--trace DIR``, a ``torch.profiler`` chrome trace of one run per mode (CPU + CUDA), the
  GPU's busy fraction during it and the median timeline of its graph steps (launch, GPU end,
  host tail after the GPU went idle, and the host ops that fill that tail).

    python benchmarks/profile_step.py --tokenizer smollm2=DIR --config smollm2-135m:smollm2:1:64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from pathlib import Path

import torch
from spec_grammar_bench.gpu import (
    GpuBenchConfig,
    ReplayDrafter,
    _build_setups,
    _documents,
    _load_tokenizer,
    _mean,
    _run_mode,
    _wrong_tokens,
)

from spec_grammar.worker.engine import SpecWorker


def gpu_busy_fraction(prof) -> float:
    """Union of CUDA kernel/memcpy intervals over the span from the first to the last one."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not spans:
        return 0.0
    busy, cur_s, cur_e = 0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / max(1, spans[-1][1] - spans[0][0])


def graph_step_timeline(trace_path: Path, top: int = 8) -> dict | None:
    """Per-step timeline of a chrome trace (``torch.profiler`` export) of CUDA-graph steps.

    A step runs from one ``cudaGraphLaunch`` to the next. Returns medians in microseconds:
    ``step``; ``launch`` (the host's ``cudaGraphLaunch`` call); ``gpu_end`` (the end of the
    graph's last kernel, from the launch: the kernels a replay runs share its correlation id);
    ``tail`` (``step - gpu_end``: host work after the forward, i.e. verify, commit, the next
    step's draft and input preparation, with the small kernels they launch), and the
    host ops (CPU ops and CUDA runtime calls) with the most time in the tails, per step. None
    when the trace has fewer than two graph launches.
    """
    import json
    from collections import Counter

    events = sorted(
        (e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    launches = [e for e in events if e["name"] == "cudaGraphLaunch"]
    if len(launches) < 2:
        return None
    graph_end: dict[int, float] = {}
    for k in events:
        if k.get("cat") == "kernel":
            c = k.get("args", {}).get("correlation")
            graph_end[c] = max(graph_end.get(c, 0.0), k["ts"] + k["dur"])
    steps, tail_ops = [], Counter()
    for a, b in zip(launches, launches[1:]):
        t0, t1 = a["ts"], b["ts"]
        ends = (
            [graph_end[a["args"]["correlation"]]]
            if a["args"].get("correlation") in graph_end
            else []
        )
        if not ends:
            continue
        gpu_end = max(ends)
        steps.append((t1 - t0, a["dur"], gpu_end - t0, t1 - gpu_end))
        for e in events:
            if gpu_end <= e["ts"] < t1 and e.get("cat") in ("cpu_op", "cuda_runtime"):
                tail_ops[e["name"]] += e["dur"]
    if not steps:
        return None
    med = {
        k: statistics.median(x[i] for x in steps)
        for i, k in enumerate(("step", "launch", "gpu_end", "tail"))
    }
    med["steps"] = len(steps)
    med["tail_ops"] = [(name, us / len(steps)) for name, us in tail_ops.most_common(top)]
    return med


def estimates(worker: SpecWorker) -> str:
    """The worker's placement estimates (ms) that decide lazy vs fill verification."""
    lazy, placement, early = worker._lazy, worker._placement, worker._early_mask
    return (
        f"fill ms/row {lazy.row_ms}, lazy ms/request {lazy.request_ms}, launch ms {placement.launch_ms}, "
        f"forward ms {early.forward_ms}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", action="append", required=True, help="MODEL:TOKENIZER:BATCH:NODES (repeatable)"
    )
    ap.add_argument(
        "--tokenizer", action="append", default=[], help="NAME=DIR or a known name (repeatable)"
    )
    ap.add_argument(
        "--modes", default="plain,overlap", help="comma-separated: plain, overlap, fill, lazy, sync"
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--grammar-threads", type=int, default=None)
    ap.add_argument("--trace", type=Path, default=None, help="write chrome traces here")
    args = ap.parse_args()

    tok_specs = {spec.partition("=")[0]: spec for spec in args.tokenizer}
    for config in args.config:
        model, tok, batch, nodes = config.split(":")
        batch, nodes = int(batch), int(nodes)
        cfg = GpuBenchConfig(
            models=[model],
            tokenizers=[tok_specs.get(tok, tok)],
            batches=[batch],
            nodes=[nodes],
            cases=1,
            device=args.device,
            dtype=args.dtype,
            eager_batches=[],
            grammar_threads=args.grammar_threads,
            cuda_graphs=None if args.device.startswith("cuda") else False,
        )
        res = dict(skipped=[])
        setups = _build_setups(
            cfg,
            torch.device(args.device),
            getattr(torch, args.dtype),
            [_load_tokenizer(t) for t in cfg.tokenizers],
            res,
            print,
        )
        if not setups:
            print(f"{config}: skipped {res['skipped']}")
            continue
        s = setups[0]
        docs = _documents(cfg, s.tokenizer, s.backend, s.tokenizer.eos_token_id)
        if not docs:
            print(f"{config}: no document")
            continue
        doc = docs[0]
        s.runner.agree_with(cfg.prompt_tokens, doc["ids"])
        prompt = [(1000 + 37 * i) % 40000 + 10 for i in range(cfg.prompt_tokens)]
        wrong = _wrong_tokens(doc["ids"], frozenset(s.backend.tokenizer_info.stop_token_ids))
        drafter = ReplayDrafter(
            doc["ids"],
            num_draft_tokens=nodes,
            chain_depth=cfg.chain_depth,
            accept_rate=cfg.accept_rate,
            wrong_token=wrong,
            seed=cfg.seed,
        )
        for mode in args.modes.split(","):
            worker = SpecWorker(
                s.runner,
                s.tokenizer,
                backend=None if mode == "plain" else s.backend,
                draft=drafter,
                overlap=mode not in ("plain", "sync"),
                grammar_threads=cfg.grammar_threads,
                lazy_grammar={"fill": False, "lazy": True}.get(mode),
            )
            try:
                _run_mode(worker, doc, batch, prompt)  # untimed: captures, allocations
                if mode != "plain":
                    print(f"{mode} after the untimed run: {estimates(worker)}")
                prof = cProfile.Profile()
                stats = []
                for _ in range(args.runs):
                    prof.enable()
                    run, _ = _run_mode(worker, doc, batch, prompt)
                    prof.disable()
                    stats += [x for x in run if x.batch_size == batch]
                print(
                    f"\n=== {config} {mode}: {len(stats)} full-batch steps; mean ms: step "
                    f"{_mean([x.step_ms for x in stats]):.3f}, draft {_mean([x.draft_ms for x in stats]):.3f}, "
                    f"launch {_mean([x.verify_forward_ms for x in stats]):.3f}, grammar "
                    f"{_mean([x.grammar_ms for x in stats]):.3f}, "
                    f"verify+commit {_mean([x.sample_ms for x in stats]):.3f}"
                )
                if mode != "plain":  # the steps by how their grammar was verified
                    for kind, sel in (
                        ("lazy", [x for x in stats if x.lazy_requests]),
                        ("fill", [x for x in stats if not x.lazy_requests]),
                    ):
                        if sel:
                            print(
                                f"  {kind} steps: {len(sel)}, mean ms: step {_mean([x.step_ms for x in sel]):.3f}, "
                                f"median {statistics.median(x.step_ms for x in sel):.3f}, grammar "
                                f"{_mean([x.grammar_ms for x in sel]):.3f}, verify+commit "
                                f"{_mean([x.sample_ms for x in sel]):.3f}, in thread "
                                f"{sum(x.grammar_in_thread for x in sel)}"
                            )
                    print(
                        f"  decisions (L lazy, F fill): {''.join('L' if x.lazy_requests else 'F' for x in stats)}; "
                        f"{estimates(worker)}"
                    )
                else:
                    print(f"  median step {statistics.median(x.step_ms for x in stats):.3f}")
                out = io.StringIO()
                st = pstats.Stats(prof, stream=out)
                st.sort_stats("tottime").print_stats(args.top)
                st.sort_stats("cumulative").print_stats("spec_grammar", args.top)
                print(
                    "\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000]
                )
                if args.trace is not None:
                    from torch.profiler import ProfilerActivity, profile

                    args.trace.mkdir(parents=True, exist_ok=True)
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                        _run_mode(worker, doc, batch, prompt)
                    path = args.trace / f"{config.replace(':', '_')}_{mode}.json"
                    tp.export_chrome_trace(str(path))
                    print(f"trace {path}; GPU busy {gpu_busy_fraction(tp):.0%} of the traced span")
                    line = graph_step_timeline(path)
                    if line is not None:
                        print(
                            f"graph steps: {line['steps']}; median us: step {line['step']:.0f}, launch "
                            f"{line['launch']:.0f}, GPU end {line['gpu_end']:.0f}, tail {line['tail']:.0f}; "
                            "host ops in the tail, us/step: "
                            + ", ".join(f"{n} {us:.0f}" for n, us in line["tail_ops"])
                        )
            finally:
                worker.close()
        s.runner.agree_with(None)


if __name__ == "__main__":
    main()
