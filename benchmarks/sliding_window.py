"""Sliding-window attention's cost against the sequence length: one attention layer (forward + backward) of the
gpt-oss debug shape scaled up (8 heads of 64, 2 KV heads), window 128, at 2k and 8k tokens, against full causal
attention with the same sinks, one process.

    python benchmarks/sliding_window.py [--seq_lens 2048,8192] [--window 128] [--output
        benchmarks/results/sliding_window_cpu.md]

The windowed layer's time per token stays flat beyond the window (its blocks never read keys outside it); the full
layer's grows with the sequence.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.hardware import cpu_model  # noqa: E402
from torchtitan.models.shared.attention import attend  # noqa: E402


def layer_seconds(seq_len: int, window: int | None, repeats: int = 3) -> float:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, seq_len, 64, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, seq_len, 64, generator=gen).requires_grad_() for _ in range(2))
    sinks = torch.zeros(8, requires_grad=True)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        attend(q, k, v, window=window, sinks=sinks).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_lens", default="2048,8192")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--output", default="benchmarks/results/sliding_window_cpu.md")
    args = parser.parse_args()
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    rows = {f"sliding window {args.window}": args.window, "full (causal)": None}
    lines = [f"# One attention layer with sinks, forward + backward ({cpu_model()}, {torch.get_num_threads()} threads,"
             " float32, 8 heads of 64, 2 KV heads, batch 1)", "",
             "| layer | " + " | ".join(f"{s:,} tokens: ms (us per token)" for s in seq_lens) + " |",
             "|---" * (len(seq_lens) + 1) + "|"]
    for label, window in rows.items():
        cells = []
        for seq in seq_lens:
            seconds = layer_seconds(seq, window)
            cells.append(f"{seconds * 1e3:.1f} ({seconds / seq * 1e6:.1f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
