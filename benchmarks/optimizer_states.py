"""Optimizer step time and optimizer-state memory per parameter on the debug models, per optimizer choice.

    python benchmarks/optimizer_states.py [--repeats 5] [--output benchmarks/results/optimizer_states.md]

For each debug model (llama3 debugmodel, qwen3_moe debugmodel, deepseek_v3 debug; float32 parameters, one
process, this machine's accelerator or else the CPU) and each optimizer (AdamW with float32 or bfloat16 states,
Muon with float32 or bfloat16 momentum, AdamW8bit): the median seconds of optimizer.step() over --repeats steps on random
gradients after two warm-up steps, the bytes of optimizer state per parameter as measured from the state
tensors, and the planner's figure for the same choice on the model's preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import torch
from report import Table, environment

from torchtitan.components.optimizers.optimizer import build_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.device import device_type
from torchtitan.protocols.train_spec import build_model_args, get_train_spec

# (family, flavor, the preset the planner reads)
MODELS = [("llama3", "debugmodel", "train_configs/debug_model.toml"),
          ("qwen3_moe", "debugmodel", "train_configs/qwen3_moe_debug.toml"),
          ("deepseek_v3", "debug", "train_configs/deepseek_v3_debug.toml")]
CHOICES = {
    "AdamW, float32 states": OptimizerConfig(name="AdamW"),
    "AdamW, bfloat16 states": OptimizerConfig(name="AdamW", state_dtype="bfloat16"),
    "Muon, float32 states": OptimizerConfig(name="Muon"),
    "Muon, bfloat16 states": OptimizerConfig(name="Muon", state_dtype="bfloat16"),
    "AdamW8bit": OptimizerConfig(name="AdamW8bit"),
}


def preset_job(preset: str, cfg: OptimizerConfig):
    from torchtitan.config import load_config

    job, _ = load_config(["--job.config_file", preset, "--training.mixed_precision_param", "float32",
                          "--optimizer.name", cfg.name, "--optimizer.state_dtype", cfg.state_dtype])
    return job


def planned_bytes_per_parameter(preset: str, cfg: OptimizerConfig) -> float:
    """The planner's optimizer state for the preset with this optimizer, per parameter of its model."""
    from torchtitan.planner import model_shape, predict_memory, resolve_layout

    job = preset_job(preset, cfg)
    shape = model_shape(job)
    return predict_memory(shape, job, resolve_layout(job, 1), on_cpu=True).optimizer / shape.params


def measure(preset: str, cfg: OptimizerConfig, device: str, repeats: int) -> tuple[float, float]:
    """The preset's model (as the planner reads it: its flavor, vocabulary and model options)."""
    from torchtitan.planner import model_shape

    job = preset_job(preset, cfg)
    spec = get_train_spec(job.model.name)
    args = build_model_args(spec, job.model, model_shape(job).vocab, job.training.seq_len)
    with torch.device(device):
        model = spec.model_cls(args)
    model.init_weights(0)
    optimizer = build_optimizer([model], cfg)
    times = []
    for i in range(repeats + 2):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    state = sum(tensor_bytes(t) for s in optimizer.state.values() for k, t in s.items() if k != "step")
    return statistics.median(times), state / sum(p.numel() for p in model.parameters())


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Storage bytes of a tensor, or of the inner tensors of a subclass (torchao's 8-bit state: codes, scales,
    code map)."""
    if hasattr(type(tensor), "__tensor_flatten__") and type(tensor) is not torch.Tensor:
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=pathlib.Path)
    args = parser.parse_args()
    device = device_type()
    table = Table(["# Optimizer step and optimizer state per parameter", "",
                   f"`python benchmarks/optimizer_states.py --repeats {args.repeats}`: float32 parameters, one "
                   f"process, median step of {args.repeats} after two warm-up steps.", f"Environment: {environment()}.",
                   "",
                   "| model | optimizer | step (ms) | x AdamW float32 | state bytes / parameter (measured) | "
                   "(planner) |", "|---|---|---|---|---|---|"], args.output)
    for family, flavor, preset in MODELS:
        baseline = None
        for label, cfg in CHOICES.items():
            cfg = dataclasses.replace(cfg, implementation="foreach" if device == "cpu" else "fused")
            seconds, measured = measure(preset, cfg, device, args.repeats)
            baseline = baseline or seconds
            planned = planned_bytes_per_parameter(preset, cfg)
            table.add(f"| {family} {flavor} | {label} | {seconds * 1e3:.1f} | {seconds / baseline:.2f} | "
                      f"{measured:.2f} | {planned:.2f} |")
    table.close()


if __name__ == "__main__":
    main()
