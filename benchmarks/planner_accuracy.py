"""Planner predictions against measurements of real training steps on this CPU.

For each configuration the trainer itself is built (one process), one warm-up step creates the
optimizer state, then one step runs under torch's MemTracker (live tensor bytes by category, not
RSS) and a few more are timed (median). Pass: memory within 20%, step time within 30%.

    python benchmarks/planner_accuracy.py [--steps 5] [--output benchmarks/results/planner_accuracy.md]
"""

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from torchtitan.config import load_config
from torchtitan.config_check import validate_config
from torchtitan.hardware import cpu_model, usable_cores
from torchtitan.log import init_logger
from torchtitan.planner import CpuTiming, format_plan, measure_cpu_timing, model_shape, plan
from torchtitan.train import Trainer

CONFIG = "train_configs/debug_model.toml"
# (name, overrides): the debug model in bf16 autocast at a few batch / length / checkpointing settings.
CASES = [
    ("batch 4 x 256, AC none", ["--training.local_batch_size", "4", "--training.seq_len", "256",
                                "--activation_checkpoint.mode", "none"]),
    ("batch 2 x 1024, AC selective 2", ["--training.local_batch_size", "2", "--training.seq_len", "1024",
                                        "--activation_checkpoint.mode", "selective",
                                        "--activation_checkpoint.selective_ac_option", "2"]),
    ("batch 8 x 512, AC full", ["--training.local_batch_size", "8", "--training.seq_len", "512",
                                "--activation_checkpoint.mode", "full"]),
]
MEMORY_TOLERANCE, TIME_TOLERANCE = 0.20, 0.30


def measure(overrides: list[str], steps: int) -> tuple[float, dict, float, CpuTiming]:
    """(peak tracked bytes, bytes by category at the peak, median step seconds, median planner timing)."""
    with tempfile.TemporaryDirectory() as dump:
        argv = ["--job.config_file", CONFIG, f"--job.dump_folder={dump}", "--training.steps", "1000",
                "--metrics.log_freq", "1000000", *overrides]
        cfg, sources = load_config(argv)
        validate_config(cfg, sources, world_size=1)
        trainer = Trainer(cfg)
        data = iter(trainer.dataloader)
        batches = [[next(data)] for _ in range(steps + 2)]
        trainer.train_step(batches[0])  # warm-up: creates the optimizer state
        tracker = MemTracker()
        tracker.track_external(*trainer.model_parts, trainer.optimizer)
        with tracker:
            trainer.train_step(batches[1])
        snapshot = tracker.get_tracker_snapshot("peak")
        peak_entry = next(iter(snapshot.values()))
        by_category = {str(k.value) if hasattr(k, "value") else str(k): v for k, v in peak_entry.items()}
        # The planner's kernel calibration runs between the timed steps, so that load from other
        # processes slows the calibration and the steps alike.
        vocab = model_shape(cfg).vocab
        times, timings = [], []
        for batch in batches[2:]:
            timings.append(measure_cpu_timing(cfg, vocab))
            start = time.perf_counter()
            trainer.train_step(batch)
            times.append(time.perf_counter() - start)
        trainer.close()
        fields = ("block", "rest", "optimizer_per_layer", "optimizer_rest")
        timing = CpuTiming(**{f: statistics.median(getattr(t, f) for t in timings) for f in fields})
        return by_category["Total"], by_category, statistics.median(times), timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--output", type=Path, help="write the markdown table here as well")
    args = parser.parse_args()
    init_logger(0)
    rows, details = [], []
    for name, overrides in CASES:
        cfg, _ = load_config(["--job.config_file", CONFIG, *overrides])
        peak, by_category, seconds, timing = measure(overrides, args.steps)
        predicted = plan(cfg, "CPU", cpu_timing=timing)
        mem_ratio = predicted.memory.total / peak
        time_ratio = predicted.step_time_s / seconds
        ok = abs(mem_ratio - 1) <= MEMORY_TOLERANCE and abs(time_ratio - 1) <= TIME_TOLERANCE
        rows.append(f"| {name} | {predicted.memory.total / 2**20:.1f} | {peak / 2**20:.1f} | {mem_ratio:.3f} | "
                    f"{predicted.step_time_s:.3f} | {seconds:.3f} | {time_ratio:.3f} | {'pass' if ok else 'FAIL'} |")
        measured = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in by_category.items() if k != "Total" and v)
        details.append(f"### {name}\n\nmeasured at the peak (MiB): {measured}\n\n```\n{format_plan(predicted)}\n```\n")
        print(rows[-1], flush=True)
    header = [
        "# Planner accuracy on CPU",
        "",
        f"Machine: {cpu_model()} ({usable_cores()} cores), torch {torch.__version__}, "
        f"Python {platform.python_version()}.",
        f"Model: {CONFIG} (debugmodel, bf16 autocast, fused AdamW), one process. Memory: peak of live tensor "
        f"bytes tracked by torch.distributed._tools.mem_tracker.MemTracker over one step after a warm-up step. "
        f"Time: median of {args.steps} steps. Pass: memory within {MEMORY_TOLERANCE:.0%}, time within "
        f"{TIME_TOLERANCE:.0%}.",
        "",
        "| config | predicted MiB | measured MiB | ratio | predicted s | measured s | ratio | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    text = "\n".join([*header, *rows, "", "## Details", "", *details])
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
