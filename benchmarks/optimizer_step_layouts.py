"""The optimizer step in a parallel layout: AdamW against Muon (each matrix orthogonalised once, on its owner rank)
on a debug preset, per rank count.

    torchrun --nproc_per_node 2 benchmarks/optimizer_step_layouts.py [--preset train_configs/debug_model.toml]
        [--repeats 5] [--output benchmarks/results/optimizer_step_layouts_cpu.md] [trainer flags ...]

The trainer builds the preset's model in the layout its flags give (default: FSDP over every rank), float32
parameters; each optimizer's step is timed on random gradients (median of --repeats after two warm-up steps, the
slowest rank's time per step), with the Newton-Schulz matrices each rank owns and the matrices in all.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from report import Table, environment

from torchtitan.config import ConfigError
from torchtitan.config_check import load_and_validate
from torchtitan.train import Trainer

CHOICES = {"AdamW": ["--optimizer.name", "AdamW"], "Muon": ["--optimizer.name", "Muon"]}


def time_step(preset: str, flags: list[str], repeats: int) -> tuple[float, str]:
    trainer = Trainer(load_and_validate(["--job.config_file", preset, "--training.mixed_precision_param",
                                         "float32", "--job.dump_folder", "/tmp/optimizer_step_layouts", *flags]))
    params = [p for part in trainer.model_parts for p in part.parameters()]
    times = []
    for i in range(repeats + 2):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        trainer.optimizer.step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(elapsed.item())
    plan = getattr(trainer.optimizer, "whole_matrices", None)
    owned = "-"
    if plan is not None:
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(plan.owned))
        owned = f"{' / '.join(map(str, counts))} of {sum(counts)}"
    trainer.close()
    return statistics.median(times), owned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="train_configs/debug_model.toml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=pathlib.Path)
    args, flags = parser.parse_known_args()
    rank = int(os.environ.get("RANK", "0"))
    if not pathlib.Path(args.preset).is_file():
        parser.error(f"--preset {args.preset}: no such file")
    table = None
    baseline = None
    for label, choice in CHOICES.items():
        try:
            seconds, owned = time_step(args.preset, [*choice, *flags], args.repeats)
        except ConfigError as e:  # a flag the trainer refuses: its one line, not a traceback from every rank
            if rank == 0:
                print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        baseline = baseline or seconds
        if rank == 0:
            if table is None:
                table = Table(["# Optimizer step in a parallel layout", "",
                               f"`torchrun --nproc_per_node {dist.get_world_size()} "
                               f"benchmarks/optimizer_step_layouts.py --preset {args.preset} {' '.join(flags)}`"
                               f" (float32 parameters; median of {args.repeats} steps, slowest rank).",
                               f"Environment: {environment()}.", "",
                               "| optimizer | ranks | step (ms) | x AdamW | Newton-Schulz matrices owned per rank |",
                               "|---|---|---|---|---|"], args.output)
            table.add(f"| {label} | {dist.get_world_size()} | {seconds * 1e3:.1f} | {seconds / baseline:.2f} | "
                      f"{owned} |")
    if table is not None:
        table.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
