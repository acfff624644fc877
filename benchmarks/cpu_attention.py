"""CPU causal attention kernels on one layer's shapes: forward and backward times, interleaved.

    python benchmarks/cpu_attention.py [--batch 8 --heads 16 --seq 2048 --head-dim 16]

Compares the kernels torchtitan.models.shared.attention can pick on CPU for bfloat16: PyTorch's flash kernel in
bfloat16 both ways, its bfloat16 forward with a float32 backward (the fallback), and the AMX kernel
(head_dim 16 on CPUs with AMX). Inputs are views of (batch, seq, heads, head_dim) tensors, as the model
passes them. Each repeat runs every kernel once, in rotating order, so drift on a shared machine spreads
evenly; the table shows medians and the fastest run.
"""

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from torchtitan.hardware import cpu_model, usable_cores
from torchtitan.models.shared import amx_attention
from torchtitan.models.shared.attention import _CpuBf16FlashAttention

_aten = torch.ops.aten


def _flash_bf16(q, k, v):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]


def kernels() -> dict:
    found = {"PyTorch flash, bf16": _flash_bf16, "PyTorch flash, bf16 fwd + fp32 bwd": _CpuBf16FlashAttention.apply}
    if amx_attention.available():
        found["AMX kernel (torchtitan)"] = amx_attention.causal_attention
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", default="benchmarks/results/cpu_attention.md")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).bfloat16().transpose(1, 2).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen).bfloat16().transpose(1, 2)
    found = kernels()
    times = {name: ([], []) for name in found}

    def run(fn):
        start = time.perf_counter()
        out = fn(q, k, v)
        mid = time.perf_counter()
        out.backward(grad)
        end = time.perf_counter()
        for t in (q, k, v):
            t.grad = None
        return mid - start, end - mid

    for fn in found.values():
        run(fn)  # warm-up (and the AMX kernel's build)
    names = list(found)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fwd, bwd = run(found[name])
            times[name][0].append(fwd)
            times[name][1].append(bwd)

    ms = 1e3
    lines = [
        f"# CPU causal attention, one layer: batch {args.batch}, {args.heads} heads, seq {args.seq}, "
        f"head_dim {args.head_dim}, bfloat16",
        "",
        f"Machine: {cpu_model()} ({usable_cores()} cores, {torch.get_num_threads()} threads), "
        f"torch {torch.__version__}, Python {platform.python_version()}. {args.repeats} rotating repeats.",
        "",
        "| kernel | forward ms (median, fastest) | backward ms (median, fastest) | total ms (median) |",
        "|---|---|---|---|",
    ]
    for name, (fwd, bwd) in times.items():
        lines.append(f"| {name} | {ms * statistics.median(fwd):.1f}, {ms * min(fwd):.1f} | "
                     f"{ms * statistics.median(bwd):.1f}, {ms * min(bwd):.1f} | "
                     f"{ms * (statistics.median(fwd) + statistics.median(bwd)):.1f} |")
    if not amx_attention.available():
        lines += ["", "The AMX kernel is not available on this machine (no AMX, or no C++ compiler)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
