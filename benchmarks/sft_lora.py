"""Supervised fine-tuning of the pretrained debug model on pydocs_chat: full vs LoRA vs QLoRA, 100 steps each;
trainable parameters, peak memory, step time and the held-out assistant loss.

    python benchmarks/sft_lora.py [--steps 100] [--runs-folder outputs/sft_lora_bench]
        [--output benchmarks/results/sft_lora_cpu.md]

The base is train_configs/debug_model.toml pretrained for 300 steps (batch 8 x 256), made once in
--runs-folder/pretrain. Each fine-tuning run is `python -m torchtitan.train` on train_configs/sft_debug.toml
(full) or train_configs/sft_lora_debug.toml (LoRA rank 16 on attention and feed-forward; QLoRA adds
--lora.base_dtype nf4) from that base, one process; the held-out loss is validation on pydocs_chat's
validation split (assistant tokens only) every 50 steps. "base" is the pretrained model before fine-tuning (a
step at lr 0). A run whose metrics already hold every step is read instead of rerun.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

from report import Table, environment

PRETRAIN = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", "300", "--training.seq_len",
            "256", "--checkpoint.enable", "--checkpoint.interval", "300", "--checkpoint.last_save_model_only",
            "false", "--validation.enable", "false"]
RUNS = {
    "full fine-tuning": ["--job.config_file", "train_configs/sft_debug.toml"],
    "LoRA (rank 16)": ["--job.config_file", "train_configs/sft_lora_debug.toml"],
    "QLoRA (rank 16, NF4 base)": ["--job.config_file", "train_configs/sft_lora_debug.toml", "--lora.base_dtype",
                                  "nf4"],
}


def rows_of(folder: pathlib.Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run(folder: pathlib.Path, options: list[str], steps: int) -> list[dict]:
    rows = rows_of(folder)
    if not any(r.get("step") == steps and "val_loss" in r for r in rows):
        command = [sys.executable, "-m", "torchtitan.train", *options, "--job.dump_folder", str(folder),
                   "--training.steps", str(steps), "--metrics.log_freq", "1"]
        print(f"# {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        rows = rows_of(folder)
    return rows


def planned(options: list[str]) -> tuple[int, int, float]:
    """(trainable, all) parameters of the run's model, built on the meta device, and the planner's bytes of its
    weights, gradients and optimizer state (the planner is held to what is allocated:
    tests/unit/test_optimizer_states.py)."""
    from torchtitan.config import load_config
    from torchtitan.hardware import DTYPES
    from torchtitan.planner import model_shape, predict_memory, resolve_layout

    # The compute dtype changes none of these; "auto" is resolved by the trainer only.
    cfg, _ = load_config([*options, "--training.mixed_precision_param", "float32"])
    shape = model_shape(cfg)
    memory = predict_memory(shape, cfg, resolve_layout(cfg, 1), on_cpu=True)
    trainable = sum(n for n, _, _, trainable in shape.tensors if trainable)
    gradients = trainable * DTYPES[cfg.training.dtype].itemsize
    return trainable, shape.params, memory.params + gradients + memory.optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs-folder", type=pathlib.Path, default=pathlib.Path("outputs/sft_lora_bench"))
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()

    pretrain = args.runs_folder / "pretrain"
    if not (pretrain / "checkpoint/step-300").is_dir():
        print(f"# pretraining the base in {pretrain}", flush=True)
        subprocess.run([sys.executable, "-m", "torchtitan.train", *PRETRAIN, "--job.dump_folder", str(pretrain)],
                       check=True, stdout=subprocess.DEVNULL)
    start = ["--checkpoint.initial_load_path", str(pretrain / "checkpoint/step-300")]
    base = run(args.runs_folder / "base", [*RUNS["full fine-tuning"], *start, "--optimizer.lr", "0",
                                           "--validation.freq", "1"], 1)
    base_loss = next(r["val_loss"] for r in base if "val_loss" in r)

    table = Table([f"# SFT of the pretrained debug model on pydocs_chat: full vs LoRA vs QLoRA, {args.steps} steps",
                   "", environment(), "",
                   "`python benchmarks/sft_lora.py`: one process, batch 8 x 512, the presets' learning rates "
                   "(full 8e-4, LoRA/QLoRA 2e-3); held-out loss = validation on pydocs_chat's validation split, "
                   "assistant tokens only (10 batches); weights + gradients + optimizer = the planner's figure for the "
                   "run's model (equal to what is allocated: the part LoRA shrinks); peak memory = the largest "
                   "`memory_gib` the trainer logged (on CPU: the process's peak resident memory, which activations "
                   "and the runtime dominate for this small model); step time = median over steps 2 onward.", "",
                   f"Held-out assistant loss of the pretrained base before fine-tuning: {base_loss:.4f}", "",
                   "| run | trainable parameters | weights + gradients + optimizer (MiB) | peak memory (GiB) | "
                   f"step time (s) | held-out loss @ 50 | held-out loss @ {args.steps} |",
                   "|---|---|---|---|---|---|---|"], args.output)
    for name, options in RUNS.items():
        rows = run(args.runs_folder / name.split()[0].lower(), [*options, *start], args.steps)
        trainable, total, state_bytes = planned(options)
        validation = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
        step_time = statistics.median(r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 1)
        memory = max(r["memory_gib"] for r in rows if "memory_gib" in r)
        table.add(f"| {name} | {trainable:,} of {total:,} ({100 * trainable / total:.2f}%) | "
                  f"{state_bytes / 2**20:.1f} | {memory:.2f} | "
                  f"{step_time:.3f} | {validation.get(50, float('nan')):.4f} | {validation[args.steps]:.4f} |")
    table.close()


if __name__ == "__main__":
    main()
