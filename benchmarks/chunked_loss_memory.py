"""Peak memory of the loss (output projection + cross-entropy, forward and backward): plain against chunked.

    python benchmarks/chunked_loss_memory.py [--tokens 8192] [--vocab 128256] [--dim 1024] [--chunk 1024]
                                              [--output benchmarks/results/chunked_loss_memory.md]

Each variant runs in a fresh process on the CPU (or on the GPU with --device cuda): the hidden states, weight
and labels are made first, then the loss is computed and back-propagated once. On the CPU the peak is the
process's peak resident set size (Linux VmHWM, reset just before the loss) above what it held then (the
allocator keeps no CPU statistics);
on a GPU it is the allocator's peak above the same baseline. Memory is the point, not speed: fp32 throughout.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import subprocess
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.components.objectives.loss import cross_entropy_sum  # noqa: E402
from torchtitan.models.shared.chunked_cross_entropy import ChunkedLinearCrossEntropy  # noqa: E402


def measure(variant: str, tokens: int, vocab: int, dim: int, chunk: int, device: str) -> dict:
    """One variant in this process: peak bytes above the inputs, and seconds."""
    torch.manual_seed(0)
    head = ChunkedLinearCrossEntropy(dim, vocab, chunk, device=device)
    h = torch.randn(tokens, dim, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_now()
        _reset_peak_rss()
    start = time.perf_counter()
    loss = head(h, labels=labels) if variant == "chunked" else cross_entropy_sum(head(h), labels)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss() - base
    return {"variant": variant, "peak_bytes": peak, "seconds": time.perf_counter() - start, "loss": loss.item()}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak_rss() -> None:
    """Linux: restart the process's peak resident set size (VmHWM) from the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", help="also write the table (markdown) here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tokens, args.vocab, args.dim, args.chunk, args.device)))
        return
    results = []
    for variant in ("plain", "chunked"):
        sizes = [arg for k in ("tokens", "vocab", "dim", "chunk", "device") for arg in (f"--{k}", str(getattr(args, k)))]
        command = [sys.executable, __file__, "--one", variant, *sizes]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    plain, chunked = results
    logits_gib = args.tokens * args.vocab * 4 / 2**30
    lines = [
        "# Chunked linear cross-entropy: peak memory of the loss",
        "",
        f"`python benchmarks/chunked_loss_memory.py`: {args.tokens:,} tokens x vocab {args.vocab:,}, hidden "
        f"{args.dim:,}, chunk {args.chunk:,} tokens, fp32, forward + backward, on {args.device} "
        f"({platform.processor() or platform.machine()}, torch {torch.__version__}). One float32 logits "
        f"tensor is {logits_gib:.2f} GiB.",
        "",
        "| loss | peak above inputs (GiB) | seconds | loss value |",
        "|---|---|---|---|",
        *(f"| {r['variant']} | {r['peak_bytes'] / 2**30:.2f} | {r['seconds']:.1f} | {r['loss']:.6f} |"
          for r in results),
        "",
        f"Saving: {(plain['peak_bytes'] - chunked['peak_bytes']) / 2**30:.2f} GiB "
        f"({plain['peak_bytes'] / max(chunked['peak_bytes'], 1):.1f}x less).",
    ]
    table = "\n".join(lines)
    print(table)
    if args.output:
        pathlib.Path(args.output).write_text(table + "\n")


if __name__ == "__main__":
    main()
