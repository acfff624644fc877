"""The optimizer phase of a training step (gradient norm, clipping, AdamW) against its memory-bandwidth floor.

    python benchmarks/optimizer_step.py [--flavor 8B --layers 8] [--vocab_size N] [--output FILE.md]

Parameters with the shapes of a llama3 flavor cut to --layers blocks, float32 with float32 gradients and AdamW
moments, on this machine's accelerator (else the CPU); random gradients with a norm far above --max_norm.
Clipping writes the scaled gradients back, so after the first repetition the scale is about 1: the kernels do
the same work whatever its value, so every repetition times the same thing.
The floor is AdamW's own traffic, 28 bytes a parameter (it reads the parameter, its gradient and both moments
and writes back the parameter and the moments), at the bandwidth a large on-device copy or add reaches here (on a
CPU the fused AdamW step can beat that probe: read the x-floor column as relative there). Rows:

- before: the trainer's sequence until this change: a float64 norm per gradient, PyTorch's
  ``clip_grads_with_norm_`` (one more read and write of every gradient), then the fused AdamW step.
- after: the trainer's ``global_grad_norm`` (one multi-tensor norm) and ``clipped_step``, where the fused
  AdamW divides by the clip scale inside its kernel (it then writes the gradient back: 4 more bytes, not 8).
- the pieces alone: each norm, and the unclipped fused step (the floor's own work).

Times are the median of --repeats timed repetitions after two warm-up ones, with the device synchronised.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import torch
from report import Table, environment

from torchtitan.components.optimizers.optimizer import clipped_step
from torchtitan.distributed.device import device_type
from torchtitan.distributed.grad_norm import global_grad_norm

ADAMW_BYTES = 28  # per float32 parameter: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


def parameter_shapes(flavor: str, layers: int, vocab_size: int | None) -> list[torch.Size]:
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.protocols.train_spec import get_train_spec

    args = llama3_flavors[flavor]
    args = dataclasses.replace(args, n_layers=layers, vocab_size=vocab_size or args.vocab_size).finalize(0, 2048)
    with torch.device("meta"):
        model = get_train_spec("llama3").model_cls(args)
    return [p.shape for p in model.parameters()]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of fn() over ``repeats`` runs after two warm-up ones."""
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def stream_bandwidth(device: str, numel: int, repeats: int) -> float:
    """Bytes/s the device's memory reaches: the better of a large float32 copy (8 bytes an element) and a sum
    of two tensors into a third (12 bytes), STREAM's copy and add."""
    a, b, out = (torch.randn(numel, device=device) for _ in range(3))
    copy = 8 * numel / timed(lambda: out.copy_(a), device, repeats)
    add = 12 * numel / timed(lambda: torch.add(a, b, out=out), device, repeats)
    return max(copy, add)


def per_parameter_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The trainer's norm before: one float64 norm kernel per gradient, then the norm of those."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params]
    return torch.linalg.vector_norm(torch.stack(norms)).float()


def command_line(args) -> str:
    """The options that shape the table (not where it is written)."""
    shown = [f"--{key} {value}" for key, value in vars(args).items() if key != "output" and value is not None]
    return " ".join(shown)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="8B", help="llama3 flavor whose dimensions are used")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, help="replace the flavor's vocabulary (a smaller run)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max_norm", type=float, default=1.0)
    parser.add_argument("--output", type=pathlib.Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    device = device_type()
    torch.manual_seed(0)
    shapes = parameter_shapes(args.flavor, args.layers, args.vocab_size)
    if not shapes[0][0]:
        parser.error(f"--vocab_size: flavor {args.flavor!r} takes the tokenizer's vocabulary; give its size")
    params = [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device) * 0.01  # norm >> max_norm
    numel = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)  # tiny lr: parameters stay where they are
    bandwidth = stream_bandwidth(device, min(numel, 1 << 28), args.repeats)
    floor = ADAMW_BYTES * numel / bandwidth

    def before():
        norm = per_parameter_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, args.max_norm, norm, foreach=True)
        optimizer.step()

    def after():
        clipped_step(optimizer, params, global_grad_norm(params), args.max_norm)

    def step_alone():
        optimizer.grad_scale = None
        optimizer.step()

    rows = [  # (name, function, ideal bytes per parameter)
        ("before: float64 norm per gradient, clip, fused AdamW", before, 4 + 8 + ADAMW_BYTES),
        ("after: global_grad_norm, clipped_step (clip inside fused AdamW)", after, 4 + 4 + ADAMW_BYTES),
        ("norm before: a float64 norm per gradient", lambda: per_parameter_norm(params), 4),
        ("norm after: global_grad_norm", lambda: global_grad_norm(params), 4),
        ("fused AdamW alone (the floor's work)", step_alone, ADAMW_BYTES),
    ]
    table = Table([
        "# Optimizer step against its bandwidth floor",
        "",
        f"`python benchmarks/optimizer_step.py {command_line(args)}`: llama3 {args.flavor} dimensions, "
        f"{args.layers} layers, vocabulary {shapes[0][0]:,}: {numel / 1e9:.3f} B float32 parameters.",
        f"Environment: {environment()}. Memory bandwidth measured (STREAM copy/add): "
        f"{bandwidth / 1e9:.1f} GB/s; floor (AdamW's {ADAMW_BYTES} B/parameter there): {floor * 1e3:.1f} ms.",
        "",
        "| phase | ms | ideal bytes/param | achieved GB/s | x floor |",
        "|---|---|---|---|---|",
    ], args.output)
    for name, fn, bytes_per_param in rows:
        seconds = timed(fn, device, args.repeats)
        row = (f"| {name} | {seconds * 1e3:.1f} | {bytes_per_param} | {bytes_per_param * numel / seconds / 1e9:.1f} "
               f"| {seconds / floor:.2f} |")
        table.add(row)
    table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
