"""Write a run's report: one HTML page with its plots, viewable anywhere without a network, and a PNG of each.

    python scripts/report.py outputs
    python scripts/report.py outputs/qwen3_moe_debug --out /tmp/moe.html --png_dir /tmp/moe_png

RUN_FOLDER is a run's job.dump_folder (it holds metrics.jsonl, and timeline/ when the run recorded its phases).
The page (default RUN_FOLDER/report.html) shows, where the run has the data: training and validation loss, the
learning rate, the gradient norm, tokens/s and MFU, step time, memory against the planner's prediction, each
rank's lag behind the median rank as a heatmap and the median rank's phases, MoE expert balance and per-expert
load, evaluation scores and RL rewards; it lists the plots left out and why. The PNGs go to --png_dir (default
REPORT_png beside the page); the ranks' Chrome traces (timeline/trace_rank*.json) are merged into REPORT.trace.json
beside it (Perfetto opens it). Running it again replaces the files it wrote, never others. docs/report.md says more.

A run that crashed or was relaunched leaves rows cut short, garbled, repeated or out of order: the report shows what
can be read, and each problem is one line ``warning: FILE:LINE: what`` on stderr and in the page.
Bad input (no such folder, no metrics.jsonl in it, an output path holding a file this script did not write) is one
line ``error: ...`` on stderr, exit 2.
"""

import argparse
import sys
from pathlib import Path

from torchtitan.output_folder import OutputError
from torchtitan.report.run_folder import METRICS_FILE
from torchtitan.script_args import ScriptParser

BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_folder", metavar="RUN_FOLDER", help="the run's dump folder (job.dump_folder)")
    parser.add_argument("--out", help="the HTML file to write (default RUN_FOLDER/report.html)")
    parser.add_argument("--png_dir", help="the folder of PNGs (default: beside --out, named after it: report_png)")
    args = parser.parse_args(argv)
    folder = Path(args.run_folder)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        return error(f"RUN_FOLDER {folder} {what}; give a run's dump folder (job.dump_folder), which holds "
                     f"{METRICS_FILE}")
    if not (folder / METRICS_FILE).is_file():
        return error(f"RUN_FOLDER {folder} holds no {METRICS_FILE}; give a run's dump folder (job.dump_folder) "
                     "after its first log step")
    # matplotlib is imported only now, so a bad command line is answered at once.
    from torchtitan.report.output import write_report

    try:
        report = write_report(folder, args.out, args.png_dir)
    except OutputError as e:
        return error(str(e))
    for problem in report.problems:
        print(f"warning: {problem}", file=sys.stderr)
    trace = f", the ranks' trace in {report.trace}" if report.trace else ""
    print(f"wrote {report.html} ({len(report.plots)} plots, {len(report.problems)} warnings), their PNGs in "
          f"{report.png_dir}{trace}")
    return 0


def error(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
