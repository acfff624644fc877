"""300 steps of the debug model per optimizer choice: an lr sweep for AdamW and Muon, then the lean states at
the best lr of the optimizer they vary; final losses, the step at which each run first reaches AdamW's best
final validation loss, and the validation curves.

    python benchmarks/optimizer_sweep.py [--steps 300] [--runs-folder outputs/optimizer_sweep_validated]
        [--output benchmarks/results/optimizer_sweep_cpu.md] [--only "AdamW lr 3.2e-3;Muon lr 3.2e-3"]

Each run is `python -m torchtitan.train` on train_configs/debug_model.toml (one process, batch 8 x 256, warm-up 10
steps, linear decay over the last 80%, validation every 25 steps) with the optimizer options below; its
metrics.jsonl stays in --runs-folder, and a run whose metrics already hold every step is read instead of rerun,
so the sweep can be extended a choice at a time. The best lr is the one with the lowest final validation loss.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from report import Table, environment

# Three points a factor of 2 apart per optimizer, with the best inside (lower ones, 4e-4 to 1.6e-3, were worse).
LRS = {"AdamW": ("3.2e-3", "6.4e-3", "1.28e-2"), "Muon": ("3.2e-3", "6.4e-3", "1.28e-2")}
SWEPT = {f"{name} lr {lr}": ["--optimizer.name", name, "--optimizer.lr", lr] for name, lrs in LRS.items()
         for lr in lrs}
# Each at the best lr of the sweep of the optimizer it is a variant of.
LEAN = {"AdamW, bfloat16 states": ("AdamW", ["--optimizer.name", "AdamW", "--optimizer.state_dtype", "bfloat16"]),
        "AdamW8bit": ("AdamW", ["--optimizer.name", "AdamW8bit"]),
        "Muon, bfloat16 states": ("Muon", ["--optimizer.name", "Muon", "--optimizer.state_dtype", "bfloat16"])}
# Validation on the same 5 x 8 held-out sequences every 25 steps: the curves to compare (a training batch's loss
# moves more with its documents than with the optimizer).
COMMON = ["--job.config_file", "train_configs/debug_model.toml", "--training.local_batch_size", "8",
          "--training.seq_len", "256", "--lr_scheduler.warmup_steps", "10", "--checkpoint.enable", "false",
          "--validation.enable", "--validation.freq", "25", "--validation.steps", "5", "--validation.seq_len", "256",
          "--validation.local_batch_size", "8"]
CURVE_EVERY = 25


def curves_of(folder: pathlib.Path) -> tuple[list[float], dict[int, float]]:
    """The training loss of every step, and the validation loss by step."""
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return ([r["loss"] for r in rows if "loss" in r],
            {r["step"]: r["val_loss"] for r in rows if "val_loss" in r})


def train(name: str, options: list[str], steps: int, runs: pathlib.Path) -> tuple[list[float], dict[int, float]]:
    folder = runs / name.replace(" ", "_").replace(",", "")
    curves = curves_of(folder)
    if len(curves[0]) != steps or steps not in curves[1]:
        (folder / "metrics.jsonl").unlink(missing_ok=True)
        command = [sys.executable, "-m", "torchtitan.train", *COMMON, "--training.steps", str(steps),
                   "--job.dump_folder", str(folder), *options]
        print(f"# {name}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        curves = curves_of(folder)
    return curves


def final_training(curve: list[float]) -> float:
    return sum(curve[-10:]) / len(curve[-10:])


def first_step_at(validation: dict[int, float], target: float) -> str:
    """The first validation step at or below the target."""
    return next((str(step) for step, loss in sorted(validation.items()) if loss <= target), "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs-folder", type=pathlib.Path, default=pathlib.Path("outputs/optimizer_sweep_validated"))
    parser.add_argument("--output", type=pathlib.Path, default=None)
    parser.add_argument("--only", default="", help="run names separated by semicolons (default: all)")
    args = parser.parse_args()
    only = [name.strip() for name in args.only.split(";") if name.strip()]
    unknown = [name for name in only if name not in SWEPT and name not in LEAN]
    if unknown:
        parser.error(f"--only names unknown runs {unknown}; runs: {'; '.join([*SWEPT, *LEAN])}")

    curves = {}
    for name, options in SWEPT.items():
        if not only or name in only:
            curves[name] = train(name, options, args.steps, args.runs_folder)
    best_lr = {}
    for optimizer in LRS:
        swept = {name: curve for name, curve in curves.items() if name.startswith(f"{optimizer} lr")}
        best_lr[optimizer] = (min(swept, key=lambda name: swept[name][1][args.steps]).split()[-1] if swept
                              else "3.2e-3")
    for name, (variant_of, options) in LEAN.items():
        if not only or name in only:
            lr = best_lr[variant_of]
            curves[f"{name} (lr {lr})"] = train(f"{name} lr {lr}", options + ["--optimizer.lr", lr], args.steps,
                                                args.runs_folder)

    adamw = [validation[args.steps] for name, (_, validation) in curves.items() if name.startswith("AdamW lr")]
    target = min(adamw, default=None)
    points = range(CURVE_EVERY, args.steps + 1, CURVE_EVERY)
    table = Table([f"# Optimizers on the debug model, {args.steps} steps", "", environment(), "",
                   "`python benchmarks/optimizer_sweep.py`: batch 8 x 256, warm-up 10 steps, linear decay over the "
                   "last 80%; validation loss on the same 5 x 8 held-out sequences every 25 steps; training loss = "
                   "mean of the last 10 steps; 'reaches' = the first validation at or below AdamW's best final "
                   f"validation loss ({target:.4f})." if target else "", "",
                   "| run | final validation loss | final training loss | reaches AdamW's best at step | "
                   + " | ".join(f"val @ {s}" for s in points) + " |",
                   "|---|---|---|---|" + "---|" * len(points)], args.output)
    for name, (training, validation) in curves.items():
        values = " | ".join(f"{validation[s]:.3f}" if s in validation else "-" for s in points)
        reaches = first_step_at(validation, target) if target else "-"
        table.add(f"| {name} | {validation[args.steps]:.4f} | {final_training(training):.4f} | {reaches} | "
                  f"{values} |")


if __name__ == "__main__":
    main()
