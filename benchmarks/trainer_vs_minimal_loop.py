"""Trainer throughput against a minimal PyTorch loop, and MFU against the measured matmul peak.

Both sides train the same model module (torchtitan's Llama 3), from the same weights, on the same
batch shape and dtype, with fused AdamW. The minimal loop is a plain Python loop over one fixed
batch: forward, cross-entropy, backward, step. The trainer runs its real loop (data loading,
loss normalisation, clipping, LR schedule, metrics). Segments of both are interleaved so that
drift in the machine's speed hits both equally.

    python benchmarks/trainer_vs_minimal_loop.py [--flavor debugmodel] [--batch 8] [--seq 2048]
        [--dtype bfloat16] [--repeats 5] [--steps 3] [--output benchmarks/results/trainer_vs_minimal_loop.md]
"""

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.components.metrics.peak_flops import device_peak_tflops, measure_matmul_tflops
from torchtitan.config import load_config
from torchtitan.config_check import validate_config
from torchtitan.hardware import DTYPES, cpu_model, usable_cores
from torchtitan.log import init_logger
from torchtitan.train import Trainer


def build_trainer(args, dump: str) -> Trainer:
    argv = [
        "--job.config_file", "train_configs/debug_model.toml", f"--job.dump_folder={dump}",
        "--model.flavor", args.flavor, "--training.local_batch_size", str(args.batch),
        "--training.seq_len", str(args.seq), "--training.mixed_precision_param", args.dtype,
        "--training.steps", "1", "--metrics.log_freq", "1000000", "--lr_scheduler.warmup_steps", "10",
        *(["--compile.enable"] if args.compile else []),
    ]
    cfg, sources = load_config(argv)
    validate_config(cfg, sources, world_size=1)
    return Trainer(cfg)


class MinimalLoop:
    """The reference: nothing but the model, autocast, cross-entropy and fused AdamW."""

    def __init__(self, trainer: Trainer, dtype: torch.dtype, compile_blocks: bool):
        model_cls = type(trainer.model_parts[0])
        with torch.device("meta"):
            self.model = model_cls(trainer.model_args)
        self.model.to_empty(device="cpu")
        self.model.init_weights(0)
        if compile_blocks:
            for name, block in list(self.model.layers.items()):
                self.model.layers.register_module(name, torch.compile(block, fullgraph=True))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=8e-4, betas=(0.9, 0.95),
                                           weight_decay=0.1, fused=True)
        self.inputs, self.labels, *_ = next(iter(trainer.dataloader))
        self.dtype = dtype

    def step(self) -> None:
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(self.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), self.labels.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def timed(fn, steps: int, tokens_per_step: int) -> float:
    start = time.perf_counter()
    fn(steps)
    return steps * tokens_per_step / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per segment")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks on both sides")
    parser.add_argument("--output", default="benchmarks/results/trainer_vs_minimal_loop.md")
    args = parser.parse_args()
    init_logger(0)
    dtype = DTYPES[args.dtype]

    with tempfile.TemporaryDirectory() as dump:
        trainer = build_trainer(args, dump)
        minimal = MinimalLoop(trainer, dtype, args.compile)
        tokens = args.batch * args.seq

        def run_trainer(steps: int) -> None:
            trainer.cfg.training.steps = trainer.step + steps
            trainer.train()

        def run_minimal(steps: int) -> None:
            for _ in range(steps):
                minimal.step()

        run_trainer(1)  # warm-up: allocator, kernel selection, compilation
        run_minimal(1)
        trainer_tps, minimal_tps, peaks = [], [], []
        for r in range(args.repeats):
            # Alternate which side goes first so neither always follows the other, and measure the
            # matmul peak in every repeat too: this VM's speed drifts, so the peak must be contemporaneous.
            order = [(run_trainer, trainer_tps), (run_minimal, minimal_tps)]
            for fn, out in order if r % 2 == 0 else order[::-1]:
                out.append(timed(fn, args.steps, tokens))
            peaks.append(measure_matmul_tflops(dtype, torch.get_num_threads(), budget_seconds=3.0))
        trainer.close()

    peak = statistics.median(peaks)
    flops_per_token = trainer.flops_per_token
    med_t, med_m = statistics.median(trainer_tps), statistics.median(minimal_tps)
    mfu_t = 100 * med_t * flops_per_token / 1e12 / peak
    mfu_m = 100 * med_m * flops_per_token / 1e12 / peak
    # Each repeat's two sides ran back to back: their ratio cancels the machine's slower drift.
    paired = statistics.median(t / m for t, m in zip(trainer_tps, minimal_tps))
    # Likewise each repeat's MFU against the peak measured right after it.
    mfu_paired = statistics.median(100 * t * flops_per_token / 1e12 / p for t, p in zip(trainer_tps, peaks))
    best_mfu = 100 * max(trainer_tps) * flops_per_token / 1e12 / max(peaks)
    # The reference the trainer logs MFU against: this machine's calibration (best of three rounds, cached).
    calibrated = device_peak_tflops(torch.device("cpu"), dtype, override=None)
    med_tflops = med_t * flops_per_token / 1e12

    def spread(xs):
        return f"{min(xs):,.0f} – {max(xs):,.0f}"

    lines = [
        f"# Trainer vs minimal loop: {args.flavor}, batch {args.batch} x {args.seq}, {args.dtype}"
        f"{', compiled blocks' if args.compile else ''}",
        "",
        f"Machine: {cpu_model()} ({usable_cores()} cores, {torch.get_num_threads()} threads), "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        f"{args.repeats} interleaved repeats of {args.steps} timed steps each, after one warm-up step per side.",
        f"Measured {args.dtype} matmul peak (median of one measurement per repeat, "
        f"{min(peaks):.3f} – {max(peaks):.3f}): {peak:.3f} TFLOP/s. FLOPs per token: {flops_per_token / 1e6:.2f} M "
        "(6 x non-embedding params + 12 x layers x heads x head_dim x seq_len).",
        "",
        "| side | median tokens/s | min – max | TFLOP/s | MFU vs measured peak |",
        "|---|---|---|---|---|",
        f"| minimal loop | {med_m:,.0f} | {spread(minimal_tps)} | {med_m * flops_per_token / 1e12:.3f} "
        f"| {mfu_m:.1f}% |",
        f"| trainer | {med_t:,.0f} | {spread(trainer_tps)} | {med_t * flops_per_token / 1e12:.3f} | {mfu_t:.1f}% |",
        "",
        f"Trainer / minimal loop: **{med_t / med_m:.3f}x** (ratio of the medians), "
        f"**{paired:.3f}x** (median of the per-repeat ratios).",
        "",
        "Trainer MFU (this VM's matmul peak changes from one measurement to the next as neighbours load the "
        "shared cores, and the trainer's speed drifts too, not in step with it):",
        f"- against this machine's calibrated peak, {calibrated:.3f} TFLOP/s (what the trainer logs MFU "
        f"against): median **{100 * med_tflops / calibrated:.1f}%**, fastest repeat "
        f"**{100 * max(trainer_tps) * flops_per_token / 1e12 / calibrated:.1f}%**",
        f"- fastest repeat against the highest peak measured (the best each side showed): **{best_mfu:.1f}%**",
        f"- median over repeats, each against the peak measured right after it: {mfu_paired:.1f}%",
        f"- median against the highest peak, the most conservative: {100 * med_tflops / max(peaks):.1f}%; "
        f"against the lowest: {100 * med_tflops / min(peaks):.1f}%",
        "",
        "Per-repeat tokens/s (trainer, minimal) and peak TFLOP/s: "
        + ", ".join(f"({t:,.0f}, {m:,.0f}, {p:.3f})" for t, m, p in zip(trainer_tps, minimal_tps, peaks)),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
