"""Benchmark reports: the one writer of a run's files (:func:`write_report`: JSON result,
Markdown report, PNG plots), shared by ``bench masks|e2e|gpu`` and the scripts, and the docs
page (``docs/benchmarks.md``) regenerated from the JSON result files.

Every number in a report is read from a result file written by a benchmark (``"kind"`` says
which); nothing is typed by hand. Each kind has one renderer (:mod:`.masks_report`,
:mod:`.e2e_report`); :data:`RENDERERS` is where a new benchmark adds its own.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "write_report",
    "write_docs",
    "load_results",
    "RENDERERS",
]


def _f(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def write_report(
    result: Any,
    out_dir: str | os.PathLike,
    stem: str,
    markdown: str | Callable[[dict[str, Path]], str],
    plots: Callable[[Path], dict[str, Path] | Iterable[Path]] | None = None,
) -> dict[str, Path]:
    """Write one run's files into ``out_dir`` (created if missing), in this order:
    ``<stem>.json`` (``result``, indent 1, values JSON cannot hold as ``str``), the plots
    (``plots(out_dir)`` returns their paths, by name or as a list named by file stem), then
    ``<stem>.md`` (``markdown``: the text, or a function of the plots' paths). Returns
    ``{"json", "markdown", **plots}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    made = plots(out) if plots is not None else {}
    made = made if isinstance(made, dict) else {p.stem: p for p in made}
    paths.update(made)
    text = markdown(made) if callable(markdown) else markdown
    paths["markdown"].write_text(text, encoding="utf-8")
    return paths


# the renderers import this module (its helpers above): load them on use
def _render_masks(res: dict[str, Any], image_dir: str | None = None) -> str:
    from .masks_report import render_masks_markdown

    return render_masks_markdown(res, image_dir)


def _write_masks(res: dict[str, Any], out_dir: Path) -> None:
    from .masks_report import write_masks_report

    write_masks_report(res, out_dir)


def _render_e2e(res: dict[str, Any], image_dir: str | None = None) -> str:
    from .e2e_report import render_e2e_markdown

    return render_e2e_markdown(res, image_dir)


def _write_e2e(res: dict[str, Any], out_dir: Path) -> None:
    from .e2e_report import write_e2e_report

    write_e2e_report(res, out_dir)


def _headline_e2e(res: dict[str, Any]) -> list[str]:
    from .e2e_report import headline_e2e

    return headline_e2e(res)


def _render_kernels(res: dict[str, Any], image_dir: str | None = None) -> str:
    from .kernels_report import render_kernels_markdown

    return render_kernels_markdown(res, image_dir)


RENDERERS: dict[str, Callable[[dict[str, Any], str | None], str]] = {
    "masks": _render_masks,
    "e2e": _render_e2e,
    "kernels": _render_kernels,
}
"""Result kind -> Markdown renderer ``(result, image_dir) -> str``."""
WRITERS: dict[str, Callable[[dict[str, Any], Path], Any]] = {
    "masks": _write_masks,
    "e2e": _write_e2e,
}
"""Result kind -> writer of its own report and plots ``(result, directory)`` (``replot``)."""
HEADLINES: dict[str, Callable[[dict[str, Any]], list[str]]] = {"e2e": _headline_e2e}
"""Result kind -> Markdown lines of a headline table for the top of the docs page."""


def load_results(dirs: list[str | os.PathLike]) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``*.json`` result file (with a known ``"kind"``) in ``dirs``.

    Raises ``FileNotFoundError`` when a directory is missing or holds no result.
    """
    found = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise FileNotFoundError(f"no results directory {d}")
        for p in sorted(d.glob("*.json")):
            try:
                res = json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                continue
            if isinstance(res, dict) and res.get("kind") in RENDERERS:
                found.append((p, res))
    if not found:
        raise FileNotFoundError(f"no benchmark result files in {', '.join(map(str, dirs))}")
    return found


def write_docs(
    dirs: list[str | os.PathLike], docs_path: str | os.PathLike, *, replot: bool = True
) -> Path:
    """Regenerate ``docs_path`` (e.g. ``docs/benchmarks.md``) from the result files in ``dirs``;
    also rewrites each directory's own report and plots when ``replot``."""
    docs = Path(docs_path)
    docs.parent.mkdir(parents=True, exist_ok=True)
    cmd = "spec-grammar bench report " + " ".join(f"--from {d}" for d in dirs) + f" --docs {docs}"
    parts = [
        "# Benchmarks",
        "",
        f"<!-- generated by `{cmd}` from the JSON result files; do not edit by hand -->",
        "",
        "Every number on this page is read from the benchmark result files next to the plots; "
        "rerun the benchmark and this command to update it.",
        "",
    ]
    results = load_results(dirs)
    for path, res in results:
        if res["kind"] in HEADLINES:
            with _readable(path, res):
                parts += HEADLINES[res["kind"]](res) + [""]
    for path, res in results:
        with _readable(path, res):
            if replot and res["kind"] in WRITERS:
                WRITERS[res["kind"]](res, path.parent)
            image_dir = os.path.relpath(path.parent, docs.parent)
            parts.append(f"Source: `{os.path.relpath(path, docs.parent)}`")
            parts.append("")
            parts.append(RENDERERS[res["kind"]](res, image_dir))
    docs.write_text("\n".join(parts), encoding="utf-8")
    return docs


@contextlib.contextmanager
def _readable(path: Path, res: dict[str, Any]):
    """A result file that says its kind but lacks what its renderer reads (cut short, or
    written by another version) is a ValueError naming the file, not a KeyError traceback."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(
            f"{path}: a {res['kind']!r} result file this version cannot read "
            f"({type(e).__name__}: {e}); rerun its benchmark"
        ) from e
