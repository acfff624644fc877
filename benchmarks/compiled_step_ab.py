"""Compiled training step time of one config under two checkouts of torchtitan, run alternately.

    git worktree add /tmp/before <commit>
    python benchmarks/compiled_step_ab.py --before /tmp/before --after . --config train_configs/qwen3_debug.toml \
        --repeats 3 --output benchmarks/results/qwen3_compiled_step.md

Each run trains --steps steps with compile.enable in its own process (cwd and PYTHONPATH = the checkout) and
reports the median step time of the steps after --skip (compilation happens in the first ones). Runs of
the two checkouts alternate, so a neighbour's load on a shared machine falls on both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(checkout: Path, config: str, steps: int, skip: int, flags: list[str]) -> float:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", config, "--compile.enable",
               "--training.steps", str(steps), "--metrics.log_freq", "1", f"--job.dump_folder={dump}", *flags]
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        result = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"error: {checkout}: {result.stderr.strip().splitlines()[-1]}")
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > skip)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout before the change")
    parser.add_argument("--after", type=Path, required=True, help="checkout after the change")
    parser.add_argument("--config", required=True, help="training TOML, relative to each checkout")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3, help="leading steps left out (compilation)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, help="also write the table here")
    args, flags = parser.parse_known_args()
    times = {"before": [], "after": []}
    for r in range(args.repeats):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for side in order:
            times[side].append(run(getattr(args, side).resolve(), args.config, args.steps, args.skip, flags))
            print(f"repeat {r + 1} {side}: {times[side][-1]:.3f} s/step", flush=True)
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    table = "\n".join([
        f"Compiled step, `{args.config}` {' '.join(flags)} ({args.repeats} alternating repeats, median of steps "
        f"{args.skip + 1}-{args.steps} each)",
        "",
        "| checkout | median s/step | repeats (s/step) |",
        "|---|---|---|",
        f"| before | {before:.3f} | {', '.join(f'{t:.3f}' for t in times['before'])} |",
        f"| after | {after:.3f} | {', '.join(f'{t:.3f}' for t in times['after'])} |",
        f"| after / before | {after / before:.3f} | |",
    ])
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
