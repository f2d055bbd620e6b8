"""Reports of the tree-mask benchmark (:mod:`.masks`): Markdown, PNG plots and its section of
``docs/benchmarks.md``. Every number is read from the ``masks`` result JSON; the renderer is
registered in :data:`spec_grammar_bench.report.RENDERERS`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import _f, _table, write_report

__all__ = [
    "write_masks_report",
    "render_masks_markdown",
    "plot_masks",
    "speedups",
    "summary_rows",
    "GOAL_SPEEDUP",
]

GOAL_SPEEDUP = 3.0
"""The grammar-layer issue's goal: ours at least this many times faster than naive."""
_METHODS = ("ours", "hook", "naive", "native")
_METHOD_TEXT = {
    "ours": "ours: `fill_tree_bitmasks` (public path)",
    "hook": "adapter hook `_fill_tree_bitmask` alone",
    "naive": "naive: SGLang-style DFS on the library API",
    "native": "library's own one-call tree fill",
}


def _rec(res: dict[str, Any], **key: Any) -> dict[str, Any] | None:
    for r in res["trees"]:
        if all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def _axes(res: dict[str, Any]) -> tuple[list[str], list[str], list[int]]:
    backends = sorted({r["backend"] for r in res["trees"]} | {c["backend"] for c in res["compile"]})
    toks = list(
        dict.fromkeys(
            [c["tokenizer"] for c in res["compile"]] + [r["tokenizer"] for r in res["trees"]]
        )
    )
    sizes = sorted({r["nodes"] for r in res["trees"]})
    return backends, toks, sizes


def speedups(res: dict[str, Any]) -> list[dict[str, Any]]:
    """``naive / ours`` time per (backend, tokenizer, N, requests, threads); naive is always
    one thread (engines fill trees one request after the other)."""
    out = []
    for r in res["trees"]:
        if r["method"] != "ours":
            continue
        naive = _rec(
            res,
            backend=r["backend"],
            tokenizer=r["tokenizer"],
            nodes=r["nodes"],
            requests=r["requests"],
            threads=1,
            method="naive",
        )
        if naive is None:
            continue
        out.append(
            {k: r[k] for k in ("backend", "tokenizer", "nodes", "requests", "threads")}
            | {
                "speedup": naive["us_per_tree"] / r["us_per_tree"],
                "ours_us_per_node": r["us_per_node"],
                "naive_us_per_node": naive["us_per_node"],
            }
        )
    return out


def render_masks_markdown(res: dict[str, Any], image_dir: str | None = None) -> str:
    """The Markdown report of a ``masks`` result. ``image_dir``: path prefix of the PNGs as
    seen from the Markdown file (None: no images)."""
    cfg, meta = res["config"], res["meta"]
    backends, toks, sizes = _axes(res)
    lines = ["## Tree-mask cost", ""]
    versions = ", ".join(
        f"{b['name']} {b['version']}" for b in res["backends"] if b.get("selected")
    )
    skipped = [f"{b['name']} ({b['error']})" for b in res["backends"] if not b.get("selected")]
    lines += [
        f"Run {meta['started']} – {meta.get('finished', '?')} on `{meta['host']}` ({meta['cpu_count']} CPUs, "
        f"{meta['cpu']}, Python {meta['python']}); load average at start/end "
        f"{meta['loadavg_start'][0]:.1f} / {meta.get('loadavg_end', [float('nan')])[0]:.1f} "
        f"(the machine is shared: expect noise). Backends: {versions}."
        + (f" Not run: {'; '.join(skipped)}." if skipped else ""),
        "",
        f"Config: tokenizers {', '.join(cfg['tokenizers'])}; trees of {', '.join(map(str, cfg['sizes']))} nodes; "
        f"{', '.join(map(str, cfg['requests']))} requests; {', '.join(map(str, cfg['threads']))} threads; "
        f"{cfg['tree_cases_per_source']} grammar(s) per source x {cfg['positions']} root positions; "
        f"{cfg['reps']} warm repetitions (fewer for batches); compile timeout {cfg['compile_timeout_s']:.0f} s, "
        f"budget {cfg['compile_budget_s']:.0f} s per source. Method: "
        "`benchmarks/spec_grammar_bench/masks.py` (module docstring). Units: µs; *per node* divides by all N nodes, "
        "*per visited* by the valid ones (root included).",
        "",
    ]
    # compile
    lines += ["### Compile time (real schemas, ms)", ""]
    rows = []
    for c in res["compile"]:
        s = c["summary"]
        cells = [
            c["backend"],
            c["tokenizer"],
            _f(c["init_s"], 2) if c["init_s"] is not None else "–",
        ]
        for src in ("jsonschemabench", "bfcl"):
            t = s.get(src)
            if t is None:
                cells += ["–"] * 3
                continue
            cells += [f"{t['ok']}/{t['total']}", _f(t["median_ms"]), _f(t["p90_ms"])]
        a = s["all"]
        cells += [str(a["failed"]), str(a["timeout"]), str(a["skipped"])]
        rows.append(cells)
    lines += _table(
        [
            "backend",
            "tokenizer",
            "tokenizer + backend init s",
            "JSB ok",
            "JSB median",
            "JSB p90",
            "BFCL ok",
            "BFCL median",
            "BFCL p90",
            "failed",
            "timeout",
            "skipped (budget)",
        ],
        rows,
    )
    lines += [
        "",
        "JSB = JSONSchemaBench sample, BFCL = `ToolCalls` of BFCL cases. Medians/p90 over successful "
        "compiles; llguidance builds its lexer lazily, so part of its cost shows in the cold walks below.",
        "",
    ]
    fails = [
        (c["backend"], c["tokenizer"], r)
        for c in res["compile"]
        for r in c["cases"]
        if r["status"] in ("failed", "timeout")
    ]
    if fails:
        lines += ["Compile failures (reason as the library gives it):", ""]
        lines += _table(
            ["backend", "tokenizer", "case", "status", "reason"],
            [
                [
                    b,
                    t,
                    r["case"],
                    r["status"],
                    (f"{r['error']}: " + (r["reason"] or ""))
                    .replace("|", "\\|")
                    .replace("\n", " ")[:160],
                ]
                for b, t, r in fails
            ],
        )
        lines.append("")
    # tree fill, one request
    lines += ["### Tree fill, one request, one thread: µs per node (µs per visited node)", ""]
    header = ["backend", "method"] + [f"{t} N={n}" for t in toks for n in sizes]
    rows = []
    for b in backends:
        for m in _METHODS:
            cells = []
            for t in toks:
                for n in sizes:
                    r = _rec(res, backend=b, tokenizer=t, nodes=n, requests=1, threads=1, method=m)
                    cells.append(
                        f"{_f(r['us_per_node'])} ({_f(r['us_per_visited'])})" if r else "–"
                    )
            if any(c != "–" for c in cells):
                rows.append([b, _METHOD_TEXT[m]] + cells)
    lines += _table(header, rows)
    lines.append("")
    setup = {s["tokenizer"]: s for s in res["tree_setup"]}
    for t in toks:
        s = setup.get(t)
        if not s:
            continue
        stats = "; ".join(
            f"N={x['nodes']}: {x['trees']} trees, {x['valid_mean']:.1f} valid nodes, "
            f"max depth {x['depth_max_mean']:.1f}"
            for x in s["trees"]
        )
        cases = ", ".join(f"`{c['case']}` ({c['instance_tokens']} tok)" for c in s["cases"])
        lines.append(f"- {t} (V={s['vocab_size']:,}): {stats}. Grammars: {cases}.")
        for e in s["excluded"]:
            lines.append(f"  - left out `{e['case']}`: {e['reason']}")
    lines.append("")
    # speedups
    sp = speedups(res)
    if sp:
        lines += [
            f"### Ours vs naive: speedup = naive time / ours time (goal ≥ {GOAL_SPEEDUP:.0f}x)",
            "",
            "Naive fills the requests one after the other on one thread, as engines do today; ours "
            "runs `fill_tree_bitmasks` on a pool of T threads (T = 1: directly).",
            "",
        ]
        header = ["backend", "tokenizer", "requests", "threads"] + [f"N={n}" for n in sizes]
        rows = []
        keys = sorted(
            {(s["backend"], s["tokenizer"], s["requests"], s["threads"]) for s in sp},
            key=lambda k: (k[0], toks.index(k[1]) if k[1] in toks else 0, k[2], k[3]),
        )
        for b, t, q, th in keys:
            cells = []
            for n in sizes:
                hit = [
                    s
                    for s in sp
                    if (s["backend"], s["tokenizer"], s["requests"], s["threads"], s["nodes"])
                    == (b, t, q, th, n)
                ]
                cells.append(
                    f"{hit[0]['speedup']:.2f}x"
                    + (" ✓" if hit[0]["speedup"] >= GOAL_SPEEDUP else "")
                    if hit
                    else "–"
                )
            rows.append([b, t, str(q), str(th)] + cells)
        lines += _table(header, rows)
        below = [s for s in sp if s["speedup"] < 1.0]
        lines.append("")
        lines.append(
            f"{sum(s['speedup'] >= GOAL_SPEEDUP for s in sp)} of {len(sp)} configurations reach the goal; "
            f"ours is slower than naive in {len(below)}."
        )
        lines.append("")
    # where the time goes
    lines += [
        "### Where the time goes (one request, one thread, µs per tree)",
        "",
        "`library` = the library's own one-call tree fill (where it has one); `hook` = the adapter's "
        "tree fill without the protocol's checks; `ours` adds the public method (argument checks, "
        "padding clear, `valid` bookkeeping); `naive` = library-API DFS.",
        "",
    ]
    rows = []
    for b in backends:
        for t in toks:
            for n in sizes:
                got = {
                    m: _rec(res, backend=b, tokenizer=t, nodes=n, requests=1, threads=1, method=m)
                    for m in _METHODS
                }
                if not got["ours"]:
                    continue
                ours, hook = (
                    got["ours"]["us_per_tree"],
                    got["hook"]["us_per_tree"] if got["hook"] else None,
                )
                rows.append(
                    [b, t, str(n)]
                    + [
                        _f(got[m]["us_per_tree"]) if got[m] else "–"
                        for m in ("native", "hook", "ours", "naive")
                    ]
                    + [f"{100 * (ours - hook) / ours:.0f} %" if hook is not None else "–"]
                )
    lines += _table(
        ["backend", "tokenizer", "N", "library", "hook", "ours", "naive", "protocol share of ours"],
        rows,
    )
    lines.append("")
    # cold
    lines += ["### Cold first walk (fresh matcher at the root), µs per node", ""]
    rows = []
    for b in backends:
        for m in ("ours", "naive"):
            cells = []
            for t in toks:
                for n in sizes:
                    r = _rec(res, backend=b, tokenizer=t, nodes=n, requests=1, threads=1, method=m)
                    cells.append(_f(r["cold_us_per_node"]) if r else "–")
            if any(c != "–" for c in cells):
                rows.append([b, m] + cells)
    lines += _table(["backend", "method"] + [f"{t} N={n}" for t in toks for n in sizes], rows)
    lines.append("")
    lines += ["### Spread over roots (ours, one request): µs per visited node, min – max", ""]
    rows = []
    for b in backends:
        cells = []
        for t in toks:
            for n in sizes:
                r = _rec(res, backend=b, tokenizer=t, nodes=n, requests=1, threads=1, method="ours")
                cells.append(
                    f"{_f(r['us_per_visited_min'])} – {_f(r['us_per_visited_max'])}" if r else "–"
                )
        rows.append([b] + cells)
    lines += _table(["backend"] + [f"{t} N={n}" for t in toks for n in sizes], rows)
    lines.append("")
    if res.get("notes"):
        lines += ["Notes on the naive baselines:", ""] + [f"- {n}" for n in res["notes"]]
        nv = [
            r
            for r in res["trees"]
            if r["method"] == "naive"
            and "naive_visited_mean" in r
            and abs(r["naive_visited_mean"] - r["visited_mean"]) > 1e-9
        ]
        if nv:
            lines += ["", "Nodes visited by naive vs ours where they differ (one request):", ""]
            lines += _table(
                ["backend", "tokenizer", "N", "ours visited", "naive visited"],
                [
                    [
                        r["backend"],
                        r["tokenizer"],
                        str(r["nodes"]),
                        _f(r["visited_mean"]),
                        _f(r["naive_visited_mean"]),
                    ]
                    for r in nv
                ],
            )
        lines.append("")
    lines += ["### Consistency checks", ""]
    if res["problems"]:
        lines += [f"- {p}" for p in res["problems"]]
    else:
        lines.append(
            "Every method reported the valid nodes the tree builder expected, and ours and naive wrote "
            "identical rows for every visited node (stop-token bits and adapter workarounds aside)."
        )
    lines.append("")
    if image_dir is not None:
        lines += ["### Plots", ""]
        for name, title in (
            ("compile_ms.png", "compile time"),
            ("tree_us_per_node.png", "tree fill µs per node"),
            ("speedup.png", "ours vs naive"),
        ):
            lines.append(f"![{title}]({image_dir.rstrip('/')}/{name})")
        lines.append("")
    return "\n".join(lines)


def plot_masks(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``compile_ms.png``, ``tree_us_per_node.png``, ``speedup.png`` into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends, toks, sizes = _axes(res)
    paths = []
    # compile time distribution
    fig, ax = plt.subplots(figsize=(8, 4))
    data, labels = [], []
    for c in res["compile"]:
        ms = [r["ms"] for r in c["cases"] if r["status"] == "ok"]
        if ms:
            data.append(ms)
            labels.append(f"{c['backend']}\n{c['tokenizer']}")
    if data:
        ax.boxplot(data, whis=(10, 90))
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
        ax.set_yscale("log")
    ax.set_ylabel("compile time, ms (box: quartiles, whiskers: p10–p90)")
    ax.set_title("Compile time of real schemas")
    fig.tight_layout()
    paths.append(out_dir / "compile_ms.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # µs per node vs N
    fig, axes = plt.subplots(
        1, max(1, len(toks)), figsize=(6 * max(1, len(toks)), 4), squeeze=False
    )
    for ax, t in zip(axes[0], toks):
        for b in backends:
            for m, style in (("ours", "-o"), ("naive", "--s"), ("native", ":^")):
                pts = [
                    (n, _rec(res, backend=b, tokenizer=t, nodes=n, requests=1, threads=1, method=m))
                    for n in sizes
                ]
                pts = [(n, r["us_per_node"]) for n, r in pts if r]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{b} {m}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("tree nodes N")
        ax.set_ylabel("µs per node (1 request, 1 thread)")
        ax.set_title(t)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "tree_us_per_node.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # speedups
    sp = speedups(res)
    fig, axes = plt.subplots(
        1, max(1, len(toks)), figsize=(7 * max(1, len(toks)), 4), squeeze=False
    )
    for ax, t in zip(axes[0], toks):
        confs = sorted(
            {(s["nodes"], s["requests"], s["threads"]) for s in sp if s["tokenizer"] == t}
        )
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            ys = []
            for conf in confs:
                hit = [
                    s["speedup"]
                    for s in sp
                    if s["tokenizer"] == t
                    and s["backend"] == b
                    and (s["nodes"], s["requests"], s["threads"]) == conf
                ]
                ys.append(hit[0] if hit else 0.0)
            ax.bar([j + i * width for j in range(len(confs))], ys, width, label=b)
        ax.axhline(
            GOAL_SPEEDUP,
            color="green",
            linestyle="--",
            linewidth=1,
            label=f"goal {GOAL_SPEEDUP:.0f}x",
        )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(confs))],
            [f"N{n}\nR{q} T{th}" for n, q, th in confs],
            fontsize=7,
        )
        ax.set_yscale("log")
        ax.set_ylabel("naive time / ours time (log)")
        ax.set_title(f"Ours vs naive, {t}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_masks_report(res: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``masks.json``, ``masks.md`` and the PNGs into ``out_dir``; returns their paths."""
    return write_report(
        res,
        out_dir,
        "masks",
        lambda _plots: (
            "# spec-grammar benchmark: tree-mask cost\n\n" + render_masks_markdown(res, ".")
        ),
        plots=lambda out: plot_masks(res, out),
    )


def summary_rows(res: dict[str, Any]) -> list[list[str]]:
    """Short per-backend summary (for the CLI): backend, tokenizer, compile median ms, µs per
    node for each N (ours, 1 request), best and worst speedup."""
    backends, toks, sizes = _axes(res)
    sp = speedups(res)
    rows = []
    for b in backends:
        for t in toks:
            comp = next(
                (c for c in res["compile"] if c["backend"] == b and c["tokenizer"] == t), None
            )
            cells = [b, t, _f(comp["summary"]["all"]["median_ms"]) if comp else "–"]
            for n in sizes:
                r = _rec(res, backend=b, tokenizer=t, nodes=n, requests=1, threads=1, method="ours")
                cells.append(_f(r["us_per_node"]) if r else "–")
            mine = [s["speedup"] for s in sp if s["backend"] == b and s["tokenizer"] == t]
            cells.append(f"{min(mine):.2f}x – {max(mine):.2f}x" if mine else "–")
            rows.append(cells)
    return rows
