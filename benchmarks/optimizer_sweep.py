"""300 steps of the debug model per optimizer choice: an lr sweep for AdamW and Muon, then the lean states at
the best lr of the optimizer they vary; final losses, the step at which each run first reaches AdamW's best final loss, and the curves.

    python benchmarks/optimizer_sweep.py [--steps 300] [--runs-folder outputs/optimizer_sweep]
        [--output benchmarks/results/optimizer_sweep_cpu.md] [--only "AdamW lr 8e-4;Muon lr 8e-4"]

Each run is `python -m torchtitan.train` on train_configs/debug_model.toml (one process, batch 8 x 256, warm-up 10
steps, linear decay over the last 80%) with the optimizer options below; its metrics.jsonl stays in
--runs-folder, and a run whose metrics already hold every step is read instead of rerun, so the sweep can be
extended a choice at a time. "final" is the mean loss of the last 10 steps (one batch's loss is noisy).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from report import Table, environment

# Three points a factor of 2 apart per optimizer, placed so that the best is not at an end where the runs allow.
LRS = {"AdamW": ("8e-4", "1.6e-3", "3.2e-3"), "Muon": ("8e-4", "1.6e-3", "3.2e-3")}
SWEPT = {f"{name} lr {lr}": ["--optimizer.name", name, "--optimizer.lr", lr] for name, lrs in LRS.items()
         for lr in lrs}
# Each at the best lr of the sweep of the optimizer it is a variant of.
LEAN = {"AdamW, bfloat16 states": ("AdamW", ["--optimizer.name", "AdamW", "--optimizer.state_dtype", "bfloat16"]),
        "AdamW8bit": ("AdamW", ["--optimizer.name", "AdamW8bit"]),
        "Muon, bfloat16 states": ("Muon", ["--optimizer.name", "Muon", "--optimizer.state_dtype", "bfloat16"])}
COMMON = ["--job.config_file", "train_configs/debug_model.toml", "--training.local_batch_size", "8",
          "--training.seq_len", "256", "--lr_scheduler.warmup_steps", "10", "--checkpoint.enable", "false"]
CURVE_EVERY = 25


def losses(folder: pathlib.Path) -> list[float]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def train(name: str, options: list[str], steps: int, runs: pathlib.Path) -> list[float]:
    folder = runs / name.replace(" ", "_").replace(",", "")
    if len(losses(folder)) != steps:
        (folder / "metrics.jsonl").unlink(missing_ok=True)
        command = [sys.executable, "-m", "torchtitan.train", *COMMON, "--training.steps", str(steps),
                   "--job.dump_folder", str(folder), *options]
        print(f"# {name}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return losses(folder)


def final(curve: list[float]) -> float:
    return sum(curve[-10:]) / len(curve[-10:])


def first_step_at(curve: list[float], target: float) -> str:
    """The first step whose 10-step trailing mean is at or below the target."""
    for step in range(10, len(curve) + 1):
        if sum(curve[step - 10:step]) / 10 <= target:
            return str(step)
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs-folder", type=pathlib.Path, default=pathlib.Path("outputs/optimizer_sweep"))
    parser.add_argument("--output", type=pathlib.Path, default=None)
    parser.add_argument("--only", default="", help="run names separated by semicolons (default: all)")
    args = parser.parse_args()
    only = [name.strip() for name in args.only.split(";") if name.strip()]

    curves = {}
    for name, options in SWEPT.items():
        if not only or name in only:
            curves[name] = train(name, options, args.steps, args.runs_folder)
    best_lr = {}
    for optimizer in LRS:
        swept = {name: curve for name, curve in curves.items() if name.startswith(f"{optimizer} lr") and curve}
        best_lr[optimizer] = min(swept, key=lambda name: final(swept[name])).split()[-1] if swept else "1.6e-3"
    adamw = {name: curve for name, curve in curves.items() if name.startswith("AdamW lr") and curve}
    for name, (variant_of, options) in LEAN.items():
        if not only or name in only:
            lr = best_lr[variant_of]
            curves[f"{name} (lr {lr})"] = train(f"{name} lr {lr}", options + ["--optimizer.lr", lr], args.steps,
                                                args.runs_folder)

    target = min((final(curve) for curve in adamw.values()), default=None)
    table = Table([f"# Optimizers on the debug model, {args.steps} steps", "", environment(), "",
                   f"Batch 8 x 256, warm-up 10, linear decay; final = mean loss of the last 10 steps; 'reaches' = "
                   f"the first step whose 10-step mean is at or below AdamW's best final loss ({target:.4f})."
                   if target else "", "",
                   "| run | final loss | reaches AdamW's best at step | "
                   + " | ".join(f"loss @ {s}" for s in range(CURVE_EVERY, args.steps + 1, CURVE_EVERY)) + " |",
                   "|---|---|---|" + "---|" * (args.steps // CURVE_EVERY)], args.output)
    for name, curve in curves.items():
        points = " | ".join(f"{curve[s - 1]:.3f}" for s in range(CURVE_EVERY, len(curve) + 1, CURVE_EVERY))
        reaches = first_step_at(curve, target) if target else "-"
        table.add(f"| {name} | {final(curve):.4f} | {reaches} | {points} |")


if __name__ == "__main__":
    main()
