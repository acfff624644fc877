"""How long a checkpoint save blocks the training loop: synchronous vs asynchronous.

The trainer's own CheckpointManager saves the full training state (model, optimizer, LR schedule,
dataloader position, train state) of a model after one training step. Synchronous saves block for
the whole write; async saves block only while the state is staged (copied), and the write happens
in the background. Repeats alternate the two modes.

    python benchmarks/async_checkpoint.py [--flavor 60M] [--repeats 5] [--output benchmarks/results/async_checkpoint.md]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from torchtitan.config import load_config
from torchtitan.config_check import validate_config
from torchtitan.log import init_logger
from torchtitan.protocols.model import count_params
from torchtitan.train import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="60M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/async_checkpoint.md")
    args = parser.parse_args()
    init_logger(0)
    with tempfile.TemporaryDirectory() as dump:
        argv = ["--job.config_file", "train_configs/debug_model.toml", f"--job.dump_folder={dump}",
                "--model.flavor", args.flavor, "--training.local_batch_size", "2", "--training.seq_len", "128",
                "--training.steps", "1", "--checkpoint.enable", "--checkpoint.keep_latest_k", "2",
                "--checkpoint.interval", "1000000", "--checkpoint.last_save_model_only=false",
                "--checkpoint.async_mode", "async"]
        cfg, sources = load_config(argv)
        validate_config(cfg, sources, world_size=1)
        trainer = Trainer(cfg)
        trainer.train()  # one step, so the optimizer state exists
        manager = trainer.checkpointer
        state_bytes = sum(t.numel() * t.element_size() for t in trainer.model_parts[0].parameters()) * 3
        blocking = {"disabled": [], "async": []}
        for r in range(args.repeats):
            for mode in ("disabled", "async") if r % 2 == 0 else ("async", "disabled"):
                manager.async_mode = mode
                start = time.perf_counter()
                manager.save(step=100 + r * 2 + (mode == "async"), last_step=10**9)
                blocking[mode].append(time.perf_counter() - start)
                manager.wait()  # finish the background write before the next measurement
        trainer.close()
        params = count_params(trainer.model_parts[0])

    sync, asyn = statistics.median(blocking["disabled"]), statistics.median(blocking["async"])
    lines = [
        f"# Checkpoint save: time the training loop is blocked ({args.flavor}: {params / 1e6:.1f}M parameters, "
        f"~{state_bytes / 2**20:.0f} MiB of model + AdamW state)",
        "",
        f"torch {torch.__version__}, CPU, local disk, {args.repeats} alternating repeats.",
        "",
        "| mode | median blocking (s) | min – max (s) |",
        "|---|---|---|",
        f"| synchronous | {sync:.3f} | {min(blocking['disabled']):.3f} – {max(blocking['disabled']):.3f} |",
        f"| async | {asyn:.3f} | {min(blocking['async']):.3f} – {max(blocking['async']):.3f} |",
        "",
        f"Async blocks for **{100 * asyn / sync:.1f}%** of a synchronous save.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
