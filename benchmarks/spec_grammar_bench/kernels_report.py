"""Report of the kernel benchmark (``benchmarks/bench_kernels.py``): the Markdown of a
``kernels`` result, for its own report and its section of ``docs/benchmarks.md`` (registered in
:data:`spec_grammar_bench.report.RENDERERS`). Every number is read from the result JSON."""

from __future__ import annotations

from typing import Any

__all__ = ["render_kernels_markdown", "APPLY", "FUSED"]

APPLY = "spec_grammar"
"""Result key of spec-grammar's apply; the other apply keys are the peers'."""
FUSED = ("fused_argmax", "apply+argmax", "fused_softmax", "apply+softmax")
"""Result keys of the fused-verification candidates."""


def _ratio(t: dict, other: str) -> str:
    return f"{t[other] / t[APPLY]:.2f}x" if other in t else "n/a"


def _us(t: dict, k: str) -> str:
    return f"{t[k] * 1e3:.1f}" if k in t else "n/a"


def _checks(c: dict) -> str:
    bad = [k for k, v in c["checks"].items() if not v]
    return "ok" if not bad else "FAIL: " + ", ".join(bad)


def _gpu_markdown(result: dict) -> list[str]:
    peers = sorted({k for c in result["cells"] for k in c["ms"]} - {APPLY} - set(FUSED))
    lines = [
        f"torch {result['torch']}, triton {result['triton']}, "
        + ", ".join(f"{p} {result.get(p + '_version', '?')}" for p in peers)
        + f"; device-to-device copy {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + "
        "write). Times in microseconds per call, every call on cold memory (input sets spanning "
        "4x the L2). 'graph': device time from CUDA-graph replays; 'eager': calls launched back "
        "to back from Python, as engines call the apply once per step (host time where it "
        "exceeds the device time). Bound = (read + write of the logits + read of the mask) / "
        "copy bandwidth. 'x' columns: their time / ours (> 1 = ours faster). "
        "Method: `benchmarks/bench_kernels.py` docstring; command: `python "
        "benchmarks/bench_kernels.py --out benchmarks/results --tag h200`.",
        "",
        "Host time of one launch (µs, one-row input): "
        + ", ".join(f"{k} {v:.1f}" for k, v in result["launch_us"].items())
        + ".",
        "",
    ]
    for kind in sorted({c["mask"] for c in result["cells"]}):
        cells = [c for c in result["cells"] if c["mask"] == kind]
        lines += [f"### {kind} masks: apply", ""]
        head = ["rows", "vocab", "dtype", "bound", "ours graph", "% of bound"]
        for p in peers:
            head += [f"{p} graph", "x"]
        head += ["ours eager"]
        for p in peers:
            head += [f"{p} eager", "x"]
        head += ["checks"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in cells:
            t, e = c["ms"], c["eager_ms"]
            row = [str(c["rows"]), f"{c['vocab']:,}", c["dtype"], f"{c['bound_ms'] * 1e3:.1f}"]
            row += [_us(t, APPLY), f"{100 * c['fraction_of_bound']:.0f}%"]
            for p in peers:
                row += [_us(t, p), _ratio(t, p)]
            row += [_us(e, APPLY)]
            for p in peers:
                row += [_us(e, p), _ratio(e, p)]
            row += [_checks(c)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        if any(f in c["ms"] for c in cells for f in FUSED):
            lines += [f"### {kind} masks: fused verification (graph, µs)", ""]
            head = ["rows", "vocab", "dtype", *FUSED]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for c in cells:
                row = [str(c["rows"]), f"{c['vocab']:,}", c["dtype"]]
                lines.append("| " + " | ".join(row + [_us(c["ms"], f) for f in FUSED]) + " |")
            lines.append("")
    if result.get("sweep"):
        lines += ["### Triton block configurations (random masks, µs graph / eager)", ""]
        configs = sorted({(r["bytes"], r["warps"]) for r in result["sweep"]})
        head = ["rows", "vocab", "dtype", *(f"{b // 1024} KiB, {w} warps" for b, w in configs)]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        shapes = sorted({(r["rows"], r["vocab"], r["dtype"]) for r in result["sweep"]})
        for rows, vocab, dname in shapes:
            got = {
                (r["bytes"], r["warps"]): r
                for r in result["sweep"]
                if (r["rows"], r["vocab"], r["dtype"]) == (rows, vocab, dname)
            }
            row = [str(rows), f"{vocab:,}", dname]
            for cfg in configs:
                r = got.get(cfg)
                row.append(f"{r['ms'] * 1e3:.1f} / {r['eager_ms'] * 1e3:.1f}" if r else "n/a")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines


def render_kernels_markdown(result: dict[str, Any], image_dir: str | None = None) -> str:
    """Markdown of a ``kernels`` result (GPU: it has ``copy_bandwidth_Bps``; else CPU).
    ``image_dir`` is unused (no plots); the signature is :data:`.report.RENDERERS`'."""
    lines = [f"## Mask apply on {result['device']}", ""]
    if "copy_bandwidth_Bps" in result:
        lines += _gpu_markdown(result)
    else:
        lines += [
            f"{result['threads']} torch threads; wall-clock medians, microseconds. "
            "'x' columns: their time / ours (> 1 = ours faster).",
            "",
        ]
        for kind in sorted({c["mask"] for c in result["cells"]}):
            lines += [f"### {kind} masks", ""]
            head = (
                "| rows | vocab | dtype | ours us | xgrammar us | xgr x | llguidance us | llg x | "
                "fused argmax us | apply+argmax us | checks |"
            )
            lines += [head, "|" + "---|" * (head.count("|") - 1)]
            for c in (c for c in result["cells"] if c["mask"] == kind):
                t = c["ms"]
                lines.append(
                    f"| {c['rows']} | {c['vocab']:,} | {c['dtype']} | {_us(t, APPLY)} | "
                    f"{_us(t, 'xgrammar')} | {_ratio(t, 'xgrammar')} | {_us(t, 'llguidance')} | "
                    f"{_ratio(t, 'llguidance')} | {_us(t, 'fused_argmax')} | "
                    f"{_us(t, 'apply+argmax')} | {_checks(c)} |"
                )
            lines.append("")
    notes = sorted(
        {f"{name}: {note}" for c in result["cells"] for name, note in c.get("notes", {}).items()}
    )
    if notes:
        lines += ["Notes:", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)
