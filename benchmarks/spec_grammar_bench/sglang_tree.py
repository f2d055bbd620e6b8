"""SGLang's draft-tree mask fill: its own walk over its built-in grammar objects against the
spec-grammar plugin's hook, side by side in one run.

Both sides get the same batch: real JSONSchemaBench schemas, a valid instance of each (sampled
from the grammar), a draft tree per request grown along the instance (:mod:`.trees`: the
instance's next token first, other children valid with probability 0.65), roots at spread
positions of the instance. A child counts as valid when both grammars allow it (``--valid-on
both``, the default), so both sides fill the rows of the same nodes: llguidance's own masks
allow only the canonical spelling of forced text where ours allow every spelling
(``--valid-on ours`` grows the trees from our grammars alone; our llguidance rows then cover
more nodes than SGLang's).

SGLang's side: ``spec_utils.generate_token_bitmask`` (a Python DFS per request,
``traverse_tree``) over ``XGrammarGrammar`` / ``GuidanceGrammar`` objects built by SGLang's own
``XGrammarGrammarBackend`` / ``GuidanceBackend`` (any whitespace, as SGLang's default). Ours:
:func:`spec_grammar.integrations.sglang.tree_fill.generate_token_bitmask` over the
``spec-grammar:<library>`` objects. Each cell is the fastest of interleaved repeats (the least
disturbed by other work on a shared host), the median beside it; the ratio is SGLang's time
over ours. Before each repeat the previous masks are dropped, as SGLang's verify step drops its
own (a mask still held cannot be reused by the hook's CPU mask pool). Requests of a batch
differ: four schemas cycled, each request at its own position of its instance with its own
tree.

The library's share: the time SGLang's walk spends inside its grammar objects'
``fill_vocab_mask`` (the library's mask computation; fastest of separate passes, each after a
call of our hook as in the timed loop). A fill that
has the library compute each row cannot take less, so "ceiling" = SGLang's walk / that share
bounds the ratio any such hook can reach.

Rows are also compared (SGLang's built-in grammars are compiled with SGLang's settings; rows
are compared on every token but the special ones, which SGLang's xgrammar grammars allow as
text inside strings and ours never do; the count of rows that still differ is printed).

    python -m spec_grammar_bench.sglang_tree [--models smollm2,gemma3] [--repeats 5]

Needs the SGLang venv of ``scripts/test_sglang.sh`` (torchvision stubbed as in the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from spec_grammar.models import ModelNotFoundError

from .inputs import jsonschemabench_cases, sample_instance
from .trees import grow_tree


def _import_sglang() -> Any:
    tests = Path(__file__).resolve().parents[2] / "tests" / "integrations"
    sys.path.insert(0, str(tests))
    import conftest  # noqa: F401  (the torchvision stub)
    from sglang.srt.speculative import spec_utils

    return spec_utils


def _sglang_backend(library: str, tok: Any, vocab: int, eos: set[int]) -> Any:
    if library == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

        return XGrammarGrammarBackend(tok, vocab_size=vocab, model_eos_token_ids=sorted(eos))
    from sglang.srt.constrained.llguidance_backend import GuidanceBackend

    return GuidanceBackend(
        tokenizer=tok, any_whitespace=True, whitespace_pattern=None, n_vocab=vocab,
        eos_token_ids=eos,
    )  # fmt: skip


class _SGLangView:
    """:func:`.trees.grow_tree`'s matcher interface over an SGLang grammar object: a copy of
    ``start`` (the object at its grammar's start state) moved along ``path``. A fork replays
    the path on a new copy (SGLang's xgrammar ``copy()`` starts over, its llguidance one copies
    the current state: replaying covers both)."""

    def __init__(self, start: Any, path: list[int], info: Any):
        self.start, self.path, self.info = start, list(path), info
        self.grammar = start.copy()
        for t in self.path:
            self.grammar.accept_token(t)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.grammar.fill_vocab_mask(bitmask, row)

    def fork(self) -> _SGLangView:
        return _SGLangView(self.start, self.path, self.info)

    def accept_token(self, token: int) -> bool:
        try:
            self.grammar.accept_token(token)
        except ValueError:  # SGLang's objects raise on a token their grammar refuses
            return False
        self.path.append(token)
        return True

    def is_terminated(self) -> bool:
        return self.grammar.is_terminated()


def _prepare(
    model: str, library: str, cases: int, sizes: list[int], seed: int, valid_on: str,
    threads: int | None,
) -> dict:  # fmt: skip
    """Per tree size: the request list (schema, prefix, tree) for the largest batch."""
    from spec_grammar.integrations.sglang import register
    from spec_grammar.integrations.sglang.grammar import THREADS_ENV, make_backend_factory
    from spec_grammar.models import load_tokenizer

    register()
    tok = load_tokenizer(model)
    vocab = len(tok)
    eos = {tok.eos_token_id}
    if threads:  # as a server sets them: the plugin's variable
        os.environ[THREADS_ENV] = str(threads)
    ours = make_backend_factory(library)(SimpleNamespace(), tok, vocab, eos)
    theirs = _sglang_backend(library, tok, vocab, eos)
    rng = random.Random(seed)
    picked = []
    for case in jsonschemabench_cases(smallest_first=True, max_schema_chars=3000):
        if len(picked) == cases:
            break
        text = sample_instance(ours.backend, case, seed)
        if text is None:
            continue
        key = json.dumps(case.schema)
        g_ours, g_theirs = ours.dispatch_json(key), theirs.dispatch_json(key)
        if not hasattr(g_ours, "matcher") or type(g_theirs).__name__ == "InvalidGrammarObject":
            continue
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) < -(-32 // cases) + 2:
            continue  # too short for each of its requests to start at its own position
        if g_ours.matcher.validate_tokens(ids) != len(ids):
            continue
        try:  # SGLang's grammar (its own compile settings) must accept the instance too
            probe = g_theirs.copy()
            for t in ids:
                probe.accept_token(t)
        except ValueError:
            continue
        picked.append((case.name, key, ids, g_ours, g_theirs))
    special = np.zeros(ours.backend.tokenizer_info.vocab_size, dtype=bool)
    special[list(ours.backend.tokenizer_info.special_token_ids)] = True
    special[list(ours.backend.tokenizer_info.stop_token_ids)] = True
    plans = {}
    per = -(-32 // len(picked))  # requests per schema
    for n in sizes:
        reqs = []
        for r in range(32):
            name, key, ids, g_ours, g_theirs = picked[r % len(picked)]
            # the requests of one schema at evenly spread, distinct positions of its instance
            # (a stride modulo the length repeated positions of short instances)
            pos = 1 + (r // len(picked)) * max(1, len(ids) - 2) // per
            m = g_ours.matcher.fork()
            m.accept_tokens(ids[:pos])
            matchers = [m]
            if valid_on == "both":
                matchers.append(_SGLangView(g_theirs, ids[:pos], m.info))
            excluded = special[: m.info.tokenizer_vocab_size]
            tree, _ = grow_tree(matchers, ids, pos, n, rng, excluded)
            reqs.append((key, ids[:pos], tree, g_ours, g_theirs))
        plans[n] = reqs
    return {"tok": tok, "vocab": vocab, "plans": plans, "special": special}


def _objects(reqs: list, side: int) -> list[Any] | None:
    """Fresh grammar objects advanced to each request's root (``side`` 3: ours, 4: SGLang's)."""
    out = []
    for r in reqs:
        g = r[side].copy()
        try:
            for t in r[1]:
                g.accept_token(t)
        except ValueError:
            return None  # SGLang's grammar refuses the instance (its settings differ)
        out.append(SimpleNamespace(grammar=g))
    return out


def _tensors(reqs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nxt = torch.stack([r[2].retrieve_next_token for r in reqs])
    sib = torch.stack([r[2].retrieve_next_sibling for r in reqs])
    toks = torch.stack([r[2].tokens for r in reqs])
    return nxt, sib, toks


def _library_ms(
    fill: Any, objs: list[Any], args: tuple, vocab: int, repeats: int, between: Any
) -> float:
    """Milliseconds SGLang's walk ``fill`` spends inside the grammar objects'
    ``fill_vocab_mask`` (fastest of ``repeats`` passes; the objects are restored). Each pass
    follows a call of ``between`` (our hook), as each timed walk does: back-to-back walks
    find the library's tables in cache and would understate its share."""
    spent = [0.0]

    def timed(method: Any) -> Any:
        def fill_vocab_mask(*a: Any) -> None:
            t0 = time.perf_counter()
            method(*a)
            spent[0] += time.perf_counter() - t0

        return fill_vocab_mask

    for o in objs:
        o.grammar.fill_vocab_mask = timed(o.grammar.fill_vocab_mask)
    best = float("inf")
    try:
        for _ in range(repeats):
            between()
            spent[0] = 0.0
            fill(objs, *args, vocab)
            best = min(best, spent[0])
    finally:
        for o in objs:
            del o.grammar.fill_vocab_mask
    return 1e3 * best


def run(models: list[str], libraries: list[str], sizes: list[int], batches: list[int],
        repeats: int, cases: int, seed: int, valid_on: str = "both",
        threads: int | None = 1) -> list[dict]:  # fmt: skip
    """One row per (model, library, draft tokens, batch): fastest and median milliseconds of
    each side, their ratios, the library's share of SGLang's walk and the ceiling it sets, and
    the rows that differ or were filled on each side."""
    spec_utils = _import_sglang()
    sglang_fill = spec_utils.generate_token_bitmask
    from spec_grammar.integrations.sglang.tree_fill import generate_token_bitmask as our_fill

    rows = []
    for model in models:
        for library in libraries:
            try:
                prep = _prepare(model, library, cases, sizes, seed, valid_on, threads)
            except ModelNotFoundError as e:  # e.g. Gemma-3's wheel not installed: bench the others
                print(f"{model}: skipped ({e})", flush=True)
                break
            vocab = prep["vocab"]
            for n in sizes:
                for bs in batches:
                    reqs = prep["plans"][n][:bs]
                    ours, theirs = _objects(reqs, 3), _objects(reqs, 4)
                    if ours is None or theirs is None:
                        print(f"{model} {library} N={n} bs={bs}: SGLang refused a prefix, skipped")
                        continue
                    args = _tensors(reqs)
                    t_ours, t_theirs = [], []
                    for _ in range(repeats):
                        # the last step's masks are dropped first, as SGLang's verify step
                        # drops its own (a local there)
                        m_theirs = m_ours = None
                        t0 = time.perf_counter()
                        m_theirs, _ = sglang_fill(theirs, *args, vocab)
                        t1 = time.perf_counter()
                        m_ours, _ = our_fill(ours, *args, vocab)
                        t2 = time.perf_counter()
                        t_theirs.append(t1 - t0)
                        t_ours.append(t2 - t1)
                    m_ours = m_theirs = None  # the pool's masks are free again, as above
                    library_ms = _library_ms(
                        sglang_fill, theirs, args, vocab, repeats,
                        lambda: our_fill(ours, *args, vocab),
                    )  # fmt: skip
                    m_theirs, _ = sglang_fill(theirs, *args, vocab)
                    m_ours, _ = our_fill(ours, *args, vocab)
                    # SGLang's xgrammar grammars allow special tokens (<|im_start|>, ...) as text
                    # in strings, ours never do: rows are compared on the other tokens
                    special = np.zeros(32 * m_ours.shape[1], dtype=bool)
                    special[: len(prep["special"])] = prep["special"]
                    special[vocab:] = True  # padding bits past the logits width
                    keep = ~torch.from_numpy(np.packbits(special, bitorder="little"))
                    diff = (m_ours ^ m_theirs) & keep.view(torch.int32)
                    differ = int(diff.any(dim=1).sum())
                    # rows each side filled (the others stay all-allowed): llguidance's own
                    # masks allow only canonical spellings, so SGLang's walk rejects (and skips)
                    # draft nodes our llguidance adapter accepts and fills
                    filled_ours = int((m_ours != -1).any(dim=1).sum())
                    filled_theirs = int((m_theirs != -1).any(dim=1).sum())
                    row = {
                        "model": model, "library": library, "draft_tokens": n, "batch": bs,
                        "threads": threads or 0,
                        "sglang_ms": 1e3 * min(t_theirs),
                        "ours_ms": 1e3 * min(t_ours),
                        "sglang_median_ms": 1e3 * statistics.median(t_theirs),
                        "ours_median_ms": 1e3 * statistics.median(t_ours),
                        "library_ms": library_ms,
                        "rows": bs * n, "rows_differ": differ,
                        "filled_sglang": filled_theirs, "filled_ours": filled_ours,
                    }  # fmt: skip
                    row["ratio"] = row["sglang_ms"] / row["ours_ms"]
                    row["ratio_median"] = row["sglang_median_ms"] / row["ours_median_ms"]
                    row["ceiling"] = row["sglang_ms"] / library_ms
                    rows.append(row)
                    print(
                        f"{model:8s} {library:10s} N={n:3d} bs={bs:3d}  sglang {row['sglang_ms']:9.2f} ms"
                        f"  ours {row['ours_ms']:8.2f} ms  ratio {row['ratio']:6.2f}x"
                        f" (medians {row['ratio_median']:5.2f}x)"
                        f"  library {library_ms:8.2f} ms (ceiling {row['ceiling']:5.2f}x)"
                        f"  rows differ {differ}/{bs * n}  filled {filled_theirs} vs {filled_ours}",
                        flush=True,
                    )
    return rows


def markdown(rows: list[dict]) -> str:
    """The table of :func:`run`'s rows."""
    out = [
        "| model | library | draft tokens | batch | SGLang walk (ms) | our hook (ms) | ratio "
        "| ratio of medians | library's share (ms) | ceiling | rows differing "
        "| rows filled (SGLang / ours) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['library']} | {r['draft_tokens']} | {r['batch']} | "
            f"{r['sglang_ms']:.2f} | {r['ours_ms']:.2f} | {r['ratio']:.2f}x | "
            f"{r['ratio_median']:.2f}x | {r['library_ms']:.2f} | {r['ceiling']:.2f}x | "
            f"{r['rows_differ']}/{r['rows']} | {r['filled_sglang']} / {r['filled_ours']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3")
    p.add_argument("--libraries", default="xgrammar,llguidance")
    p.add_argument("--draft-tokens", default="16,64")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", type=int, default=4, help="real schemas per batch (cycled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1,
        help="threads of our backends' batched tree fill (SPEC_GRAMMAR_SGLANG_THREADS; 0: the "
        "backend's default: xgrammar 1, llguidance 80%% of the CPUs); SGLang's walk runs on one",
    )  # fmt: skip
    p.add_argument(
        "--valid-on", choices=("both", "ours"), default="both",
        help="grow trees whose valid children both grammars allow (same rows on both sides), "
        "or our grammars alone",
    )  # fmt: skip
    p.add_argument("--out", help="write the rows as JSON and the table as Markdown here (stem)")
    a = p.parse_args(argv)
    rows = run(
        a.models.split(","), a.libraries.split(","), [int(x) for x in a.draft_tokens.split(",")],
        [int(x) for x in a.batches.split(",")], a.repeats, a.cases, a.seed, a.valid_on, a.threads,
    )  # fmt: skip
    table = markdown(rows)
    print(table)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(rows, indent=1))
        Path(a.out + ".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
