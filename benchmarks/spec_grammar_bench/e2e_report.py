"""Reports of the end-to-end benchmark (:mod:`.e2e`): Markdown, PNG plots and the headline
table of ``docs/benchmarks.md``. Every number is read from the ``e2e`` result JSON; the
renderer is registered in :data:`spec_grammar_bench.report.RENDERERS`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .e2e import REFERENCE_ROW
from .report import _f, _table, write_report

__all__ = [
    "render_e2e_markdown",
    "plot_e2e",
    "write_e2e_report",
    "headline_e2e",
    "goal_ratios",
    "GOAL_SPEEDUP_VS_HF",
    "GOAL_CONSTRAINED_VS_FREE",
]

GOAL_SPEEDUP_VS_HF = 2.0
"""Issue goal: ours constrained speculative >= this many times HF generate + grammar processor."""
GOAL_CONSTRAINED_VS_FREE = 1.0
"""Issue goal: constrained speculative at least as fast as unconstrained speculative."""
PLOTS = (
    ("e2e_tokens_per_s.png", "tokens/s per row"),
    ("e2e_accept_length.png", "accept length per row"),
    ("e2e_outcomes.png", "outcome of every generation per row"),
)
_CAUSES = {
    "near-tie": "the two tokens' logits are within 0.01 of each other at the first difference: float "
    "noise of a different kernel or shape (a tree-attention verify forward vs HF's one-token "
    "decode) decides the argmax",
    "mask-ref": "the reference grammar (xgrammar) forbids the row's token there: the row's mask let "
    "through a token xgrammar does not",
    "mask-row": "xgrammar allows both tokens and the reference token has the clearly higher logit, so the "
    "row's own mask must have forbidden it: the libraries' masks differ (token spellings such "
    'as ` {` vs ` {"`, whitespace, number forms)',
    "other": "the row's token has the clearly higher logit yet the reference did not pick it: worth a look",
}


def _summary(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["row"]: s for s in res["summary"]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goal_ratios(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, one entry per our constrained speculative row: tokens/s ratios (end to
    end and decode only) vs :data:`REFERENCE_ROW` and vs ours unconstrained speculative, validity of completed outputs,
    identical fraction vs the reference."""
    s = _summary(res)
    ref, free = s.get(REFERENCE_ROW), s.get("ours-spec/unconstrained")
    out = []
    for row in res["rows"]:
        if row["family"] != "ours" or not row["constrained"] or row["speculation"] == "none":
            continue
        me = s[row["id"]]
        out.append(
            {
                "row": row["id"],
                "vs_hf": _ratio(me["tokens_per_s"], ref and ref["tokens_per_s"]),
                "vs_hf_decode": _ratio(
                    me["decode_tokens_per_s"], ref and ref["decode_tokens_per_s"]
                ),
                "vs_unconstrained": _ratio(me["tokens_per_s"], free and free["tokens_per_s"]),
                "vs_unconstrained_decode": _ratio(
                    me["decode_tokens_per_s"], free and free["decode_tokens_per_s"]
                ),
                "valid": me["valid"],
                "completed": me["completed"],
                "identical": me["identical"],
                "compared": me["compared"],
            }
        )
    return out


def _outcome(me: dict[str, Any]) -> str:
    if me["errors"] and not me["ok"]:
        return f"**failed {me['errors']}/{me['prompts']}**"
    return f"{me['valid']}/{me['completed']}" + (
        f" ({me['errors']} failed)" if me["errors"] else ""
    )


def headline_e2e(res: dict[str, Any]) -> list[str]:
    """The 3–5 line headline table (ours spec vs HF generate + processor, with and without HF
    speculation), for the top of ``docs/benchmarks.md`` and the README."""
    s = _summary(res)
    ref = s.get(REFERENCE_ROW)
    want = [
        "ours-spec/xgrammar",
        "ours-nospec/xgrammar",
        REFERENCE_ROW,
        "hf/xgrammar+pld",
        "hf/llguidance+pld",
    ]
    rows = []
    for rid in want:
        me = s.get(rid)
        if me is None:
            continue
        ratio = _ratio(me["decode_tokens_per_s"], ref and ref["decode_tokens_per_s"])
        rows.append(
            [
                me["label"],
                _f(me["tokens_per_s"]),
                _f(me["decode_tokens_per_s"]),
                f"{ratio:.2f}x" if ratio else "–",
                _f(me["accept_length"], 2),
                _outcome(me),
                f"{me['identical']}/{me['compared']}"
                if me["compared"]
                else ("reference" if rid == REFERENCE_ROW else "–"),
            ]
        )
    cfg = res["config"]
    n = len(res["prompts"])
    lines = [
        f"End to end, {cfg['model']} on CPU, greedy, {n} real prompts (JSONSchemaBench + BFCL), "
        f"≤ {cfg['max_new_tokens']} new tokens ([details](#end-to-end-generation)):",
        "",
    ]
    lines += _table(
        [
            "",
            "tokens/s",
            "decode tokens/s",
            "decode vs HF + xgrammar",
            "tokens per forward",
            "valid / completed",
            "same tokens as HF + xgrammar",
        ],
        rows[:5],
    )
    return lines


def render_e2e_markdown(res: dict[str, Any], image_dir: str | None = None) -> str:
    """The Markdown report of an ``e2e`` result. ``image_dir``: path prefix of the PNGs as seen
    from the Markdown file (None: no images)."""
    cfg, meta = res["config"], res["meta"]
    s = _summary(res)
    ref = s.get(REFERENCE_ROW)
    n_jsb = sum(p["source"] == "jsonschemabench" for p in res["prompts"])
    n_bfcl = len(res["prompts"]) - n_jsb
    lines = ["## End-to-end generation", ""]
    lines += [
        f"Run {meta['started']} – {meta['finished']} on `{meta['host']}` ({meta['cpu_count']} CPUs, {meta['cpu']}, "
        f"{meta['torch_threads']} torch threads; torch {meta['torch']}, transformers {meta['transformers']}, "
        f"xgrammar {meta['xgrammar']}, llguidance {meta['llguidance']}); load average at start/end "
        f"{meta['loadavg_start'][0]:.1f} / {meta['loadavg_end'][0]:.1f} (a shared machine: compare rows, "
        "which ran interleaved, rather than absolute numbers).",
        "",
        f"Model `{cfg['model']}` (float32, CPU), greedy, one request at a time, at most {cfg['max_new_tokens']} new "
        f"tokens; {n_jsb} JSONSchemaBench schemas + {n_bfcl} BFCL tool-call cases, the same chat prompt for every "
        f"row. Ours: drafter `{cfg['draft']}` ({cfg['num_draft_tokens']} nodes per tree). HF: prompt lookup "
        f"`prompt_lookup_num_tokens={cfg['prompt_lookup_num_tokens']}`; assistant = the target's first "
        f"{cfg['assistant_layers']} layers (shared weights), HF's default schedule. Method: "
        "`benchmarks/spec_grammar_bench/e2e.py` (module docstring)."
        + (
            f" Rows left out of this run (time): {', '.join(f'`{r}`' for r in cfg['skip_rows'])}."
            if cfg.get("skip_rows")
            else ""
        )
        + (
            f" Prompts not reached within the {cfg['time_budget_s']:.0f} s time budget: "
            f"{', '.join(f'`{n}`' for n in res['prompts_skipped'])}."
            if res.get("prompts_skipped")
            else ""
        ),
        "",
    ]
    header = [
        "row",
        "tokens/s",
        "vs HF + xgrammar",
        "decode tokens/s",
        "decode vs HF + xgrammar",
        "accept length",
        "completed",
        "valid / completed",
        "cut by limit",
        "failed",
        "compile ms (median)",
        "TTFT ms (median)",
        "same tokens as HF + xgrammar",
    ]
    rows = []
    for row in res["rows"]:
        me = s[row["id"]]
        ident = (
            "reference"
            if row["id"] == REFERENCE_ROW
            else f"{me['identical']}/{me['compared']}"
            if me["compared"]
            else "–"
        )
        rows.append(
            [
                me["label"],
                _f(me["tokens_per_s"]),
                f"{_ratio(me['tokens_per_s'], ref and ref['tokens_per_s']):.2f}x"
                if _ratio(me["tokens_per_s"], ref and ref["tokens_per_s"])
                else "–",
                _f(me["decode_tokens_per_s"]),
                f"{_ratio(me['decode_tokens_per_s'], ref and ref['decode_tokens_per_s']):.2f}x"
                if _ratio(me["decode_tokens_per_s"], ref and ref["decode_tokens_per_s"])
                else "–",
                _f(me["accept_length"], 2),
                f"{me['completed']}/{me['ok']}",
                f"{me['valid']}/{me['completed']}"
                if row["constrained"] or me["completed"]
                else "–",
                str(me["cut"]),
                f"{me['errors']}/{me['prompts']}",
                _f(me["compile_ms_median"]) if row["constrained"] else "–",
                _f(me["ttft_ms_median"], 0),
                ident,
            ]
        )
    lines += _table(header, rows)
    lines += [
        "",
        "*tokens/s*: output tokens over generation seconds (prefill included), summed over the prompts "
        "a row completed without error; *decode tokens/s*: the tokens after the first over the seconds "
        "after the first token (no prefill: where speculation acts); "
        "*accept length*: output tokens per target forward; "
        "*valid*: `jsonschema` Draft "
        "2020-12 on outputs that reached a stop token; *cut by limit*: hit `max_new_tokens`. Compile "
        "times are each library's own schema compile (llguidance builds most of its matcher lazily, so "
        "its cost shows in TTFT).",
        "",
    ]
    # goals
    lines += ["### Goals", ""]
    for g in goal_ratios(res):

        def x(v: float | None) -> str:
            return f"{v:.2f}x" if v else "–"

        def met(v: float | None, goal: float) -> str:
            return "met" if v and v >= goal else "not met"

        lines.append(
            f"- `{g['row']}`: {x(g['vs_hf'])} the tokens/s of HF + xgrammar, {x(g['vs_hf_decode'])} decode only "
            f"(goal ≥ {GOAL_SPEEDUP_VS_HF:.0f}x: {met(g['vs_hf'], GOAL_SPEEDUP_VS_HF)} / "
            f"{met(g['vs_hf_decode'], GOAL_SPEEDUP_VS_HF)}); {x(g['vs_unconstrained'])} ours unconstrained "
            f"speculative, {x(g['vs_unconstrained_decode'])} decode only (goal ≥ {GOAL_CONSTRAINED_VS_FREE:.1f}x: "
            f"{met(g['vs_unconstrained'], GOAL_CONSTRAINED_VS_FREE)} / "
            f"{met(g['vs_unconstrained_decode'], GOAL_CONSTRAINED_VS_FREE)}); "
            f"{g['valid']}/{g['completed']} completed outputs valid; {g['identical']}/{g['compared']} token-identical "
            "to HF + xgrammar greedy."
        )
    lines += [
        "",
        "Unconstrained outputs differ from constrained ones (different text, often prose or code), so "
        "that ratio compares speeds on different outputs.",
        "",
    ]
    # per source
    lines += ["### Tokens/s by source", ""]
    prow = []
    for row in res["rows"]:
        cells = [s[row["id"]]["label"]]
        for src in ("jsonschemabench", "bfcl"):
            ok = [
                x
                for x in res["samples"]
                if x["row"] == row["id"] and x["source"] == src and x["status"] == "ok"
            ]
            wall = sum(x["wall_s"] for x in ok)
            toks = sum(x["tokens"] for x in ok)
            fwd = sum(x["forwards"] for x in ok)
            cells += [_f(toks / wall) if wall else "–", _f(toks / fwd, 2) if fwd else "–"]
        prow.append(cells)
    lines += _table(
        ["row", "JSB tokens/s", "JSB accept length", "BFCL tokens/s", "BFCL accept length"], prow
    )
    lines.append("")
    # failures
    fails = [
        (s[r["id"]]["label"], msg, n)
        for r in res["rows"]
        for msg, n in s[r["id"]]["error_counts"].items()
    ]
    lines += ["### Failures (recorded as they happened)", ""]
    if fails:
        lines += _table(
            ["row", "error", "count"],
            [
                [lab, "`" + msg.replace("|", "\\|").replace("`", "'") + "`", str(n)]
                for lab, msg, n in fails
            ],
        )
    else:
        lines.append("None.")
    lines.append("")
    # divergences
    div = [x for x in res["samples"] if "divergence" in x]
    lines += ["### Token-identity with HF generate + xgrammar (greedy, no speculation)", ""]
    if div:
        causes: dict[str, int] = {}
        for x in div:
            causes[x["divergence"]["cause"]] = causes.get(x["divergence"]["cause"], 0) + 1
        lines += [
            f"{len(div)} outputs differ from the reference. At the first differing token, the cause:",
            "",
        ]
        lines += [f"- **{c}** ({n}): {_CAUSES[c]}." for c, n in sorted(causes.items())]
        lines += [
            "",
            *_table(
                [
                    "row",
                    "prompt",
                    "position",
                    "reference token",
                    "token",
                    "allowed (ref / other)",
                    "logit gap",
                    "cause",
                ],
                [
                    [
                        s[x["row"]]["label"],
                        f"`{x['prompt']}`",
                        str(x["divergence"]["pos"]),
                        f"`{json.dumps(x['divergence']['ref_token'])}`",
                        f"`{json.dumps(x['divergence']['token'])}`",
                        f"{'yes' if x['divergence']['ref_allowed'] else 'no'} / "
                        f"{'yes' if x['divergence']['token_allowed'] else 'no'}",
                        f"{x['divergence']['logit_gap']:.4f}",
                        x["divergence"]["cause"],
                    ]
                    for x in div
                ],
            ),
        ]
    else:
        compared = sum(1 for x in res["samples"] if "identical" in x)
        lines.append(
            f"All {compared} compared outputs are token-identical to the reference."
            if compared
            else "Nothing to compare (the reference row did not run or failed)."
        )
    lines.append("")
    bad = [x for x in res["samples"] if x.get("valid") is False]
    if bad:
        lines += ["### Invalid completed outputs", ""]
        lines += _table(
            ["row", "prompt", "reason"],
            [
                [
                    s[x["row"]]["label"],
                    f"`{x['prompt']}`",
                    (x["invalid_reason"] or "").replace("|", "\\|").replace("\n", " ")[:140],
                ]
                for x in bad
            ],
        )
        lines.append("")
    if image_dir is not None:
        lines += ["### Plots", ""]
        lines += [f"![{title}]({image_dir.rstrip('/')}/{name})" for name, title in PLOTS]
        lines.append("")
    return "\n".join(lines)


def plot_e2e(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the :data:`PLOTS` PNGs into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = _summary(res)
    rows = res["rows"]
    labels = [s[r["id"]]["label"] for r in rows]
    colors = ["tab:blue" if r["family"] == "ours" else "tab:orange" for r in rows]
    paths = []
    for name, key, xlabel in (
        ("e2e_tokens_per_s.png", "tokens_per_s", "output tokens / s (higher is better)"),
        ("e2e_accept_length.png", "accept_length", "output tokens per target forward"),
    ):
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
        vals = [s[r["id"]][key] or 0.0 for r in rows]
        y = list(range(len(rows)))[::-1]
        ax.barh(y, vals, color=colors)
        for yi, r, v in zip(y, rows, vals):
            me = s[r["id"]]
            note = f" failed {me['errors']}/{me['prompts']}" if me["errors"] else ""
            ax.text(
                v,
                yi,
                f" {v:.2f}{note}" if v else f" {note.strip() or 'n/a'}",
                va="center",
                fontsize=7,
            )
        ax.set_yticks(y, labels, fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_title(
            f"End to end, {res['config']['model']} on CPU (blue: ours, orange: HF generate)"
        )
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    y = list(range(len(rows)))[::-1]
    left = [0.0] * len(rows)
    for part, color in (
        ("valid", "tab:green"),
        ("invalid", "tab:red"),
        ("cut", "tab:gray"),
        ("failed", "black"),
    ):
        vals = []
        for r in rows:
            me = s[r["id"]]
            vals.append(
                {
                    "valid": me["valid"],
                    "invalid": me["completed"] - me["valid"],
                    "cut": me["cut"],
                    "failed": me["errors"],
                }[part]
            )
        ax.barh(y, vals, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel("prompts")
    ax.set_title("Outcome per generation (valid = jsonschema-valid completed output)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "e2e_outcomes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_e2e_report(res: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``e2e.json``, ``e2e.md`` and the PNGs into ``out_dir``; returns their paths."""
    return write_report(
        res,
        out_dir,
        "e2e",
        lambda _plots: (
            "# spec-grammar benchmark: end to end\n\n"
            + "\n".join(headline_e2e(res))
            + "\n\n"
            + render_e2e_markdown(res, ".")
        ),
        plots=lambda out: plot_e2e(res, out),
    )
