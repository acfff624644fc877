"""The report page: one HTML file that needs nothing else to be viewed (no network, no files beside it).

Pictures are PNG data URIs; each plot's data follows its picture as ``<script type="application/json"
class="plot-data" data-plot=NAME>``; a few lines of inline script check, once the page has loaded, that every
picture decoded and every data block parses, and say so on the body (``data-rendered="N plots"``) and in the
``report-errors`` list (empty when all is well), which is what a headless browser test reads.
"""

from __future__ import annotations

import base64
import html
import json

from torchtitan.output_folder import generated_header
from torchtitan.report.figures import Plot
from torchtitan.report.run_folder import Problem, Run

# The page's first line: this marker and a hash of the rest (output_folder.generated_header), inside a comment
# that the second line closes; an HTML comment may come before the doctype.
MARKER = "<!-- torchtitan scripts/report.py"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.5em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 0.9em; }
.warnings li { font-family: monospace; color: #8a4b00; }
#report-errors li { color: #b00020; font-weight: bold; }
.summary, .note { color: #444; } code { background: #f4f4f4; padding: 0 0.2em; }
"""

# Runs once the page (and so every data-URI picture) has loaded.
_CHECK = """
window.addEventListener("load", function () {
  var errors = [], decoded = 0;
  document.querySelectorAll("img.plot").forEach(function (img) {
    if (img.complete && img.naturalWidth > 0) { decoded += 1; }
    else { errors.push("plot " + img.alt + " did not decode"); }
  });
  document.querySelectorAll("script.plot-data").forEach(function (block) {
    try { JSON.parse(block.textContent); }
    catch (e) { errors.push("plot data " + block.dataset.plot + ": " + e.message); }
  });
  var list = document.getElementById("report-errors");
  errors.forEach(function (text) {
    var item = document.createElement("li");
    item.textContent = text;
    list.appendChild(item);
  });
  document.body.dataset.rendered = decoded + " plots";
});
"""


def page(run: Run, plots: list[Plot], notes: list[str], trace_name: str | None, png_dir: str) -> str:
    """The whole file, its first line the generated header."""
    body = "\n".join([
        "-->",
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_text(_title(run))}</title><style>{_STYLE}</style></head>",
        "<body>",
        f"<h1>{_text(_title(run))}</h1>",
        f'<p class="summary">{_text(_summary(run))}</p>',
        _warnings(run.problems),
        '<ul id="report-errors"></ul>',
        *map(_figure, plots),
        _absent(notes),
        _files_note(trace_name, png_dir),
        f"<script>{_CHECK}</script>",
        "</body></html>",
        "",
    ])
    return generated_header(MARKER, body) + body


def _text(value: str) -> str:
    return html.escape(value, quote=True)


def _title(run: Run) -> str:
    model = (run.config or {}).get("model", {})
    name = f"{model.get('name')}/{model.get('flavor')}" if isinstance(model, dict) and model.get("name") else None
    return f"Run report: {run.folder.resolve().name}" + (f" ({name})" if name else "")


def _summary(run: Run) -> str:
    parts = [f"folder {run.folder.resolve()}"]
    if run.training:
        parts.append(f"{len(run.training)} training rows, steps {run.training[0]['step']}-{run.training[-1]['step']}")
    else:
        parts.append("no training rows")
    parts += [f"{len(rows)} {kind} rows" for kind, rows in (("validation", run.validation),
                                                              ("evaluation", run.evaluation)) if rows]
    if run.timeline:
        parts.append(f"timelines of {len(run.timeline)} ranks")
    if run.plan:
        parts.append(f"planned for {run.plan.get('device', '?')} x {run.plan.get('world_size', '?')}: "
                     f"{run.plan['memory_gib']['total']:.3g} GiB per device")
    return "; ".join(parts)


def _warnings(problems: list[Problem]) -> str:
    if not problems:
        return ('<section class="warnings" id="warnings"><h2>Warnings</h2><p>None: every file read cleanly.</p>'
                "</section>")
    items = "".join(f"<li>{_text(str(problem))}</li>" for problem in problems)
    return (f'<section class="warnings" id="warnings"><h2>Warnings ({len(problems)})</h2><p>Problems in the run '
            f"folder; the report shows what could be read.</p><ul>{items}</ul></section>")


def _data_json(data: dict) -> str:
    # "</" would end the script element early; JSON allows the escaped solidus.
    return json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


def _figure(plot: Plot) -> str:
    picture = base64.b64encode(plot.png).decode("ascii")
    name = _text(plot.name)
    return (f'<figure id="plot-{name}"><h2>{_text(plot.title)}</h2>'
            f'<img class="plot" alt="{name}" src="data:image/png;base64,{picture}">'
            f"<figcaption>{_text(plot.caption)}</figcaption>"
            f'<script type="application/json" class="plot-data" data-plot="{name}">{_data_json(plot.data)}</script>'
            "</figure>")


def _absent(notes: list[str]) -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{_text(note)}</li>" for note in notes)
    return f'<section id="absent"><h2>Not in this run</h2><ul>{items}</ul></section>'


def _files_note(trace_name: str | None, png_dir: str) -> str:
    trace = (f"The ranks' Chrome traces are merged into <code>{_text(trace_name)}</code> beside this file (open it "
             "in Perfetto, ui.perfetto.dev, or chrome://tracing). " if trace_name else "")
    return f'<p class="note">{trace}Each plot is also a PNG in <code>{_text(png_dir)}</code>.</p>'
