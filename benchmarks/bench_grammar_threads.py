"""The grammar work of one worker step alone, split over 1..N threads, side by side.

``SpecWorker.grammar_work`` (advance every matcher, fill every draft tree's bitmask rows)
over a batch of real JSONSchemaBench schemas with xgrammar, without the model: each request's
matcher is first walked some tokens into its grammar (seeded choice among the allowed tokens),
then gets a draft tree of ``--nodes`` nodes whose tokens are all legal (a chain of allowed
tokens plus one legal sibling per chain node), so every node costs a full row. The same step
is timed with every thread count (``--reps`` times each, interleaved; the best and the median
time reported: the best is the least disturbed by other load on a shared host), and
every thread count must give the rows and validity of one thread (a mismatch is printed).
The worker benchmark (``bench_worker.py --grammar-threads``) times the same work inside whole
runs; this one isolates it from the forward (a 2-core host shares its cores with it).
``--placements caller,thread,thread+busy,pinned`` also times where the work runs: on the
calling thread, in a worker thread while the caller waits for it, in a worker thread while the
caller first runs 0.1 ms of Python (as the worker's thread does after a graph replay returns),
in a worker thread while the caller keeps a core busy for 0.5 ms without the GIL (hashing, as
a graph replay's launch does), or in a worker thread pinned to the core next to the caller's
(both pinned; Linux only).

    python benchmarks/bench_grammar_threads.py --batches 16,32 --nodes 16,64 --threads 1,2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from spec_grammar.datasets import jsonschemabench_sample
from spec_grammar.errors import SpecGrammarError
from spec_grammar.specs import JsonSchema
from spec_grammar.tree import DraftTree
from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.request import RequestState
from spec_grammar.worker.sampling import SamplingParams


def legal_walk(
    matcher, steps: int, rng: random.Random, row: torch.Tensor, stops: set[int]
) -> list[int]:
    """Up to ``steps`` tokens accepted one by one, each a seeded pick among the allowed
    non-stop tokens (stops early where only a stop token is allowed)."""
    out = []
    for _ in range(steps):
        matcher.fill_next_token_bitmask(row, 0)
        allowed = [t for t in allowed_token_ids(row[0], matcher.info.vocab_size) if t not in stops]
        if not allowed:
            break
        tok = rng.choice(allowed)
        matcher.accept_token(tok)
        out.append(tok)
    return out


def legal_tree(matcher, root: int, nodes: int, rng: random.Random, row, stops) -> DraftTree:
    """A tree of at most ``nodes`` legal nodes: a chain of allowed tokens and, under each
    chain node, one more allowed child (the matcher is unchanged afterwards)."""
    fork = matcher.fork()
    depth = (nodes - 1 + 1) // 2
    chain = legal_walk(fork, depth, rng, row, stops)
    tokens, parents = [root] + chain, [-1] + list(range(len(chain)))
    fork = matcher.fork()
    for d, tok in enumerate(chain):
        if len(tokens) >= nodes:
            break
        fork.fill_next_token_bitmask(row, 0)
        others = [
            t
            for t in allowed_token_ids(row[0], fork.info.vocab_size)
            if t != tok and t not in stops
        ]
        if others:
            tokens.append(rng.choice(others))
            parents.append(d)
        fork.accept_token(tok)
    return DraftTree(tokens, parents)


def _spin_bytes(seconds: float) -> bytes:
    """A buffer that sha256 takes about ``seconds`` to hash on this host."""
    probe = bytes(1 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(probe)
    per_byte = (time.perf_counter() - t0) / len(probe)
    return bytes(max(4096, int(seconds / per_byte)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokenizer",
        default="smollm2",
        help="smollm2, gemma3, NAME=DIR or DIR (with tokenizer.json)",
    )
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--nodes", default="16,64", help="draft-tree sizes, root included")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument(
        "--walk", type=int, default=12, help="tokens each matcher is walked into its grammar first"
    )
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--placements",
        default="caller",
        help="caller, thread, thread+busy, thread+spin, pinned (comma-separated)",
    )
    args = ap.parse_args()
    placements = args.placements.split(",")
    pool = ThreadPoolExecutor(max_workers=1)
    pinned_pool = None
    spin_bytes = _spin_bytes(0.5e-3) if "thread+spin" in placements else b""
    if "pinned" in placements:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[0]})
        pinned_pool = ThreadPoolExecutor(
            max_workers=1, initializer=os.sched_setaffinity, initargs=(0, {cores[1 % len(cores)]})
        )

    def timed(worker, live, trees, mask, placement):
        """(wall ms seen by the caller, the work's own ms)."""
        t0 = time.perf_counter()
        if placement == "caller":
            work = worker.grammar_work(live, trees, [], mask)
        else:
            fut = (pinned_pool if placement == "pinned" else pool).submit(
                worker.grammar_work, live, trees, [], mask
            )
            if placement == "thread+busy":
                end = time.perf_counter() + 1e-4
                while time.perf_counter() < end:
                    pass
            elif placement == "thread+spin":
                hashlib.sha256(spin_bytes)  # releases the GIL while it hashes
            work = fut.result()
        return (time.perf_counter() - t0) * 1e3, work

    from spec_grammar_bench.gpu import _load_tokenizer

    from spec_grammar.registry import get_backend
    from spec_grammar.testing.model_shapes import build_model

    name, tok = _load_tokenizer(args.tokenizer)
    # the model never runs (only the grammar work is timed): a tiny one with the tokenizer's ids
    model = build_model("tiny", "cpu", torch.float32, vocab_size=len(tok))
    backend = get_backend(args.backend, tok, vocab_size=model.config.vocab_size)
    threads = [int(x) for x in args.threads.split(",")]
    workers = {
        t: SpecWorker(model, tok, backend=backend, draft="none", overlap=False, grammar_threads=t)
        for t in threads
    }
    stops = set(backend.tokenizer_info.stop_token_ids)
    row = allocate_token_bitmask(1, backend.vocab_size)
    compiled = []
    for r in jsonschemabench_sample():
        try:
            compiled.append(backend.compile(JsonSchema(r["schema"])))
        except SpecGrammarError:  # a schema the backend refuses is left out
            continue
        if len(compiled) >= max(int(b) for b in args.batches.split(",")):
            break
    print(
        f"grammar work of one step ({args.backend}, {name} tokenizer, {os.cpu_count()} cores), "
        f"matchers walked {args.walk} tokens in, {args.reps} reps"
    )
    print(
        f"{'batch':>5} {'nodes':>5} {'threads':>7} {'placement':>11} {'best ms':>8} {'x 1st':>6} {'median ms':>9} "
        f"{'x 1st':>6} {'us/node':>8} {'inner med':>9}"
    )
    params = SamplingParams()
    for batch in [int(b) for b in args.batches.split(",")]:
        for nodes in [int(n) for n in args.nodes.split(",")]:
            rng = random.Random(batch * 1000 + nodes)
            live, trees = [], []
            for i, c in enumerate(compiled[:batch]):
                m = backend.matcher(c)
                walked = legal_walk(m, args.walk, rng, row, stops)
                st = RequestState(
                    request=Request([1], None, params, rid=f"r{i}"), prompt_ids=[1], sampling=params
                )
                st.matcher = m
                live.append(st)
                trees.append(legal_tree(m, walked[-1] if walked else 0, nodes, rng, row, stops))
            rows = sum(t.num_nodes for t in trees)
            keys = [(t, p) for t in threads for p in placements]
            times = {k: [] for k in keys}
            inner = {k: [] for k in keys}
            results = {}
            for _ in range(args.reps):
                for t, p in keys:
                    mask = workers[t]._bitmasks.acquire(rows)  # the worker's reused host buffers
                    ms, work = timed(workers[t], live, trees, mask, p)
                    times[t, p].append(ms)
                    inner[t, p].append(work.ms)
                    results[t, p] = (
                        mask.clone(),
                        {k: v.tolist() for k, v in work.valid.items()},
                        dict(work.errors),
                    )
            best0, med0 = min(times[keys[0]]), statistics.median(times[keys[0]])
            for k in keys:
                best, med = min(times[k]), statistics.median(times[k])
                print(
                    f"{batch:5d} {nodes:5d} {k[0]:7d} {k[1]:>11} {best:8.2f} {best0 / best:6.2f} {med:9.2f} "
                    f"{med0 / med:6.2f} {best * 1e3 / rows:8.1f} {statistics.median(inner[k]):9.2f}"
                )
                ref_mask, ref_valid, ref_err = results[keys[0]]
                mask, valid, err = results[k]
                if not (torch.equal(mask, ref_mask) and valid == ref_valid and err == ref_err):
                    print(f"  !! {k} rows differ from {keys[0]}")
    for w in workers.values():
        w.close()
    pool.shutdown()
    if pinned_pool is not None:
        pinned_pool.shutdown()


if __name__ == "__main__":
    main()
