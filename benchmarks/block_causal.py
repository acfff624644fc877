"""Block-causal vs causal attention: one training step (forward + backward) of the debug model on CPU.

    python benchmarks/block_causal.py [--batch 2 --seq 2048 --documents 1 4 16 --repeats 5]

Each sequence holds N documents of equal length. "causal" attends across them (the packed default);
"block_causal" runs the model with the batch's document ids and per-document positions, as training with
model.attention_mask = "block_causal" does (on CPU: causal attention per document span). With more
documents the block-causal attention does less work (sum of squares of the spans instead of the square of
the row). Every repeat runs each case once, in rotating order, so drift on a shared machine spreads
evenly; the table shows medians and the fastest run. The compute dtype is float32 unless --dtype says
otherwise (check that the CPU computes bfloat16 fast before asking for it).
"""

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from torchtitan.data import document_positions
from torchtitan.hardware import DTYPES, cpu_model, usable_cores
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.shared.decoder import Decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--documents", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--output", default="benchmarks/results/block_causal.md")
    args = parser.parse_args()

    model_args = llama3_flavors[args.flavor].finalize(2048, args.seq)
    with torch.device("meta"):
        model = Decoder(model_args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.to(DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 2048, (args.batch, args.seq), generator=gen)

    cases = {}
    for n in args.documents:
        ids = (torch.arange(args.seq) * n // args.seq).expand(args.batch, -1)
        cases[f"causal, {n} documents"] = {}
        cases[f"block_causal, {n} documents"] = {"document_ids": ids, "positions": document_positions(ids)}

    def step(inputs):
        start = time.perf_counter()
        model(tokens, **inputs).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    names = list(cases)
    times = {name: [] for name in names}
    for name in names:
        step(cases[name])  # warm-up
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(step(cases[name]))

    lines = [
        f"# Block-causal vs causal: {args.flavor} training step (forward + backward), batch {args.batch} x seq "
        f"{args.seq}, {args.dtype}, CPU",
        "",
        f"Machine: {cpu_model()} ({usable_cores()} cores, {torch.get_num_threads()} threads), "
        f"torch {torch.__version__}, Python {platform.python_version()}. {args.repeats} rotating repeats.",
        "",
        "Causal attention does the same work whatever the document count (its rows are timed once per count",
        "as a control); block_causal attends within each document only.",
        "",
        "| case | step ms (median) | fastest ms | vs causal (median) |",
        "|---|---|---|---|",
    ]
    for name in names:
        causal = statistics.median(times[name.replace("block_causal", "causal")])
        median = statistics.median(times[name])
        lines.append(f"| {name} | {1e3 * median:.0f} | {1e3 * min(times[name]):.0f} | {median / causal:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
