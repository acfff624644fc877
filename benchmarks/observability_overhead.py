"""What recording the step phases costs: the same FSDP run with observability.record_phases on and off, alternately.

    python benchmarks/observability_overhead.py --repeats 3 --output benchmarks/results/observability_overhead.md

Each run is `torchrun --nproc_per_node 2` of the debug model under FSDP 2 (--steps steps, every step a log step, so
every step also pays the per-rank summary's all-gather and the trace rewrite: the most the recorder ever costs); its
figure is the median step time of the steps after --skip. Runs alternate on, off, off, on, ... so that a drift of
the machine's load falls on both. The recorder also measures its own time (marks, rows, the summary) and logs it
as observability/overhead_pct: its median is the last column.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import Table, environment  # benchmarks/report.py (the script's folder is on sys.path)

FLAGS = ["--job.config_file", "train_configs/debug_model.toml", "--parallelism.data_parallel_shard_degree", "2",
         "--training.seq_len", "512", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
         "--checkpoint.no_enable"]


def run(on: bool, steps: int, skip: int) -> tuple[float, float | None]:
    """(median step seconds, median recorder share of a step in %) of one run."""
    with tempfile.TemporaryDirectory() as dump:
        flags = [*FLAGS, "--training.steps", str(steps), f"--job.dump_folder={dump}"]
        if not on:
            flags.append("--observability.no_record_phases")
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend", "c10d",
                                 "--rdzv_endpoint=localhost:0",
                                 "-m", "torchtitan.train", *flags], capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"error: the run failed: {(result.stderr or result.stdout).strip().splitlines()[-1]}")
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    step = statistics.median(r["step_time_s"] for r in rows if "loss" in r and r["step"] > skip)
    shares = [r["observability/overhead_pct"] for r in rows if "observability/overhead_pct" in r and r["step"] > skip]
    return step, statistics.median(shares) if shares else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out (warm-up)")
    parser.add_argument("--output", type=Path, help="also write the table here")
    args = parser.parse_args()
    table = Table([f"Step phases recorded or not: {' '.join(FLAGS[1:])}, {args.steps} steps, median of steps "
                   f"{args.skip + 1}-{args.steps} per run; {environment()}", "",
                   "| run | record_phases | median step (s) | recorder's own time (% of the step) |",
                   "|---|---|---|---|"], args.output)
    times = {True: [], False: []}
    for repeat in range(args.repeats):
        for on in ((True, False) if repeat % 2 == 0 else (False, True)):
            step, share = run(on, args.steps, args.skip)
            times[on].append(step)
            table.add(f"| {repeat + 1} | {'on' if on else 'off'} | {step:.4f} | "
                      f"{'' if share is None else f'{share:.3f}'} |")
    on, off = statistics.median(times[True]), statistics.median(times[False])
    table.add(f"| median | on / off | {on:.4f} / {off:.4f} | on is {100 * (on / off - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
