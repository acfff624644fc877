"""Writing a report: the HTML page, a PNG per plot and the merged Chrome trace.

A report is written again as a run goes on, so its files are replaced, but only files this script wrote (as
output_folder.py asks of every script): the page by its first line's marker and hash (an edited page is refused
too), a PNG by the "Software" text its metadata carries, the trace by its "otherData". Every output is checked
before anything is written; a file in the way is an OutputError naming it. A PNG of an earlier report whose plot is
gone now is removed with the others' replacement, so the folder always matches the page.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from torchtitan.output_folder import OutputError, file_problem
from torchtitan.report.figures import PNG_SOFTWARE, Plot, make_plots
from torchtitan.report.html import MARKER, page
from torchtitan.report.run_folder import Problem, merged_trace, read_run

_TRACE_WRITER = {"written_by": "torchtitan scripts/report.py"}


@dataclass
class Report:
    html: Path
    png_dir: Path
    trace: Path | None  # None: the run has no traces
    plots: list[Plot]
    notes: list[str]  # what was left out
    problems: list[Problem]


def default_png_dir(html: Path) -> Path:
    return html.with_name(f"{html.stem}_png")


def trace_path(html: Path) -> Path:
    """The merged trace beside the page, named after it (two reports in one folder keep their own)."""
    return html.with_name(f"{html.stem}.trace.json")


def write_report(folder: str | Path, html: str | Path | None = None, png_dir: str | Path | None = None) -> Report:
    """Read the run folder and write its report; the page defaults to FOLDER/report.html, the PNGs to a folder
    beside it named after it."""
    folder = Path(folder)
    html = Path(html) if html is not None else folder / "report.html"
    png_dir = Path(png_dir) if png_dir is not None else default_png_dir(html)
    _check_outputs(html, png_dir, trace_path(html))  # before the work, so a bad path is answered at once
    run = read_run(folder)
    plots, notes = make_plots(run)
    trace = trace_path(html) if run.traces else None
    pngs = {png_dir / f"{plot.name}.png": plot.png for plot in plots}
    stale = _check_pngs(png_dir, pngs)
    try:
        html.parent.mkdir(parents=True, exist_ok=True)
        png_dir.mkdir(parents=True, exist_ok=True)
        for path, data in pngs.items():
            _write(path, data)
        for path in stale:
            path.unlink()
        if trace is not None:
            content = {**merged_trace(run.traces), "otherData": _TRACE_WRITER}
            _write(trace, json.dumps(content, separators=(",", ":")).encode())
        elif _is_our_trace(trace_path(html)):  # an earlier report's, of traces no longer there
            trace_path(html).unlink()
        _write(html, page(run, plots, notes, trace.name if trace else None, os.path.relpath(png_dir, html.parent))
               .encode("utf-8"))
    except OSError as e:
        raise OutputError(f"cannot write the report: {e.filename or html}: {e.strerror or e}") from None
    return Report(html, png_dir, trace, plots, notes, run.problems)


def _check_outputs(html: Path, png_dir: Path, trace: Path) -> None:
    """Raise OutputError for an output path holding something this script did not write."""
    if problem := file_problem(html, MARKER):
        raise OutputError(f"--out {html} {problem}")
    if png_dir.exists() and not png_dir.is_dir():
        raise OutputError(f"--png_dir {png_dir} is a file; give a folder (new, or one this script wrote)")
    if trace.exists() and not _is_our_trace(trace):
        raise OutputError(f"{trace} (the merged trace beside --out) exists and was not written by this script; give "
                          "another --out (or remove it first)")


def _check_pngs(png_dir: Path, pngs: dict[Path, bytes]) -> list[Path]:
    """Raise OutputError for a PNG to write that this script did not write; return the PNGs of an earlier report
    that this one has no plot for."""
    for path in pngs:
        if path.exists() and not _is_our_png(path):
            raise OutputError(f"--png_dir {png_dir} holds {path.name}, which this script did not write; give another "
                              "folder (or remove it first)")
    return sorted(p for p in png_dir.glob("*.png") if p not in pngs and _is_our_png(p)) if png_dir.is_dir() else []


def _is_our_png(path: Path) -> bool:
    try:
        return path.is_file() and f"Software\0{PNG_SOFTWARE}".encode() in path.read_bytes()
    except OSError:
        return False


def _is_our_trace(path: Path) -> bool:
    try:
        return path.is_file() and json.loads(path.read_text()).get("otherData") == _TRACE_WRITER
    except (OSError, ValueError, AttributeError):
        return False


def _write(path: Path, data: bytes) -> None:
    """Write whole: a reader never sees half a file (a browser reloading the page while the report is redone)."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
