"""Cost of ``fork`` and ``fill_tree_bitmask`` after a long output, on every backend.

Why: a matcher that copies its whole token history on ``fork`` (or keeps an unbounded rollback
history) gets slower with every token it accepts; a request writing 20,000 tokens then pays
two orders of magnitude more per draft branch than one writing 50. The protocol only asks for
``max_rollback_tokens`` of history, so both costs should not depend on the output's length.

Method: SmolLM2 tokenizer, the schema ``{"type": "array", "items": {"type": "integer"}}``
(compact), and the text ``[1,2,3,...`` tokenized once. Per backend and per ``N`` in
``--lengths``: a fresh matcher accepts the first ``N`` tokens (the array stays open), then
``fork()`` and ``fill_tree_bitmask`` on a small draft tree (8 nodes: digits and commas that
continue the document) are timed over ``--repeat`` calls each, best of ``--rounds`` rounds
(median per call in each round); so is ``backend.fill_tree_bitmasks`` for two such requests
at once (llguidance with 2 threads: its batched fill, the two walks on threads). The longest length is
compared with the shortest in the same run (ratios, side by side), so a noisy host moves both
alike.

    OMP_NUM_THREADS=1 PYTHONPATH=benchmarks python -m spec_grammar_bench.long_history \
        [--backends xgrammar,llguidance,outlines] [--lengths 50,20000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.registry import get_backend
from spec_grammar.specs import JsonSchema
from spec_grammar.tree import DraftTree

SCHEMA = {"type": "array", "items": {"type": "integer"}}


def _document_tokens(tok: Any, n: int) -> list[int]:
    """At least ``n + 8`` tokens of ``[1,2,3,...`` (an open array of integers)."""
    k = max(16, n)
    while True:
        ids = tok.encode("[" + ",".join(str(i) for i in range(1, k)), add_special_tokens=False)
        if len(ids) >= n + 8:
            return ids
        k *= 2


def _tree(tok: Any, root: int) -> DraftTree:
    """8 nodes: the root, then ``1``, ``2`` with ``,`` and ``3`` below them (valid after a
    digit or a comma: the open array accepts a digit, and a comma after a digit)."""
    d1, d2, d3, comma = (tok.convert_tokens_to_ids(x) for x in ("1", "2", "3", ","))
    return DraftTree.from_parents(
        tokens=[root, d1, d2, comma, d3, comma, d3, d1],
        parents=[-1, 0, 0, 1, 3, 2, 5, 4],
    )


def _per_call(fn, repeat: int, rounds: int) -> float:
    """Best over ``rounds`` of the median seconds per call of ``fn`` (``repeat`` calls)."""
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best


def measure(
    backend_name: str, tok: Any, lengths: list[int], *, repeat: int = 50, rounds: int = 3
) -> dict[str, Any]:
    """Per length: ``fork_us`` and ``fill_us`` (microseconds per call) and, once, the
    ``accept_s`` it took to accept that many tokens. Raises ``ValueError`` if the backend
    refuses a token of the document (it would not be measuring what it says)."""
    # llguidance fills several requests' trees in parallel with 2+ threads: that path too
    extra = {"num_threads": 2} if backend_name == "llguidance" else {}
    backend = get_backend(backend_name, tok, max_rollback_tokens=256, **extra)
    compiled = backend.compile(JsonSchema(SCHEMA, whitespace="compact"))
    ids = _document_tokens(tok, max(lengths))
    out: dict[str, Any] = {"backend": backend_name, "lengths": {}}
    for n in lengths:
        m = backend.matcher(compiled)
        t0 = time.perf_counter()
        got = m.accept_tokens(ids[:n])
        accept_s = time.perf_counter() - t0
        if got != n:
            raise ValueError(f"{backend_name} accepted {got} of {n} document tokens")
        tree = _tree(tok, ids[n - 1])
        bitmask = allocate_token_bitmask(tree.num_nodes, backend.vocab_size)
        valid = m.fill_tree_bitmask(tree, bitmask)
        if not bool(valid[1]):
            raise ValueError(f"{backend_name}: the draft tree's first node is refused at N={n}")
        forks: list[Any] = []
        fork_s = _per_call(lambda: forks.append(m.fork()), repeat, rounds)
        forks.clear()
        fill_s = _per_call(lambda: m.fill_tree_bitmask(tree, bitmask), repeat, rounds)
        other = backend.matcher(compiled)
        other.accept_tokens(ids[:n])
        jobs = [(m, tree, 0), (other, tree, tree.num_nodes)]
        rows = allocate_token_bitmask(2 * tree.num_nodes, backend.vocab_size)
        batch_s = _per_call(lambda: backend.fill_tree_bitmasks(jobs, rows), repeat, rounds)
        out["lengths"][n] = {
            "fork_us": fork_s * 1e6,
            "fill_us": fill_s * 1e6,
            "batch_fill_us": batch_s * 1e6,
            "accept_s": accept_s,
        }
    return out


_COLUMNS = (("fork_us", "fork"), ("fill_us", "fill"), ("batch_fill_us", "2-request fill"))


def table(results: list[dict[str, Any]], lengths: list[int]) -> str:
    """Markdown: per backend, microseconds per ``fork``, per ``fill_tree_bitmask`` and per
    2-request ``fill_tree_bitmasks`` at each length, each with the ratio of the longest length
    to the shortest."""
    lo, hi = lengths[0], lengths[-1]
    head = ["backend"]
    for _, what in _COLUMNS:
        head += [f"{what} us N={n}" for n in lengths] + [f"{what} x ({hi}/{lo})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        ls = r["lengths"]
        cells = [r["backend"]]
        for key, _ in _COLUMNS:
            xs = [ls[n][key] for n in lengths]
            cells += [f"{x:.1f}" for x in xs] + [f"{xs[-1] / xs[0]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="xgrammar,llguidance,outlines")
    ap.add_argument("--lengths", default="50,20000", help="accepted tokens, comma-separated")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    from spec_grammar.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    results = [
        measure(b, tok, lengths, repeat=args.repeat, rounds=args.rounds)
        for b in args.backends.split(",")
    ]
    print(table(results, lengths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
