"""Tokens/s the data pipeline alone delivers to one rank, against what the trainer consumes on the debug model.

    python benchmarks/data_pipeline.py [--trainer-tps N | --trainer-steps 8] [--output benchmarks/data_pipeline.md]

The pipeline is measured as the trainer uses it (debug preset: pydocs, seq_len 2048, local batch 8):
rank 0's loader for each source (on-the-fly tokenization with each tokenizer format, and the same documents
pre-tokenized into shards by scripts/tokenize_dataset.py, dataset_format "tokens"), worker count and
data-parallel degree. Every rank reads the whole global stream and keeps 1/dp of it, so what one rank receives
falls with dp; the "x trainer" column compares it with the trainer's tokens/s per device, which must stay
below 1/20 of it, and "x on-the-fly" the shards with the faster on-the-fly format in the same setting.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.data import build_dataloader, build_tokenizer, load_pydocs_documents  # noqa: E402

SEQ_LEN, LOCAL_BATCH = 2048, 8
REQUIRED_RATIO = 20


def pipeline_tps(tokenizer_file: str, num_workers: int, dp: int, batches: int,
                 shards: str | None = None) -> tuple[float, float]:
    """(seconds to the first batch, steady tokens/s after it) of rank 0's loader; from ``shards`` if given."""
    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"), tokenizer_file)
    loader = build_dataloader(tokenizer, dataset="pydocs", dataset_path=shards, seq_len=SEQ_LEN,
                              local_batch_size=LOCAL_BATCH, dp_rank=0, dp_world_size=dp, num_workers=num_workers,
                              dataset_format="tokens" if shards else "text")
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    for _ in range(batches):
        tokens += next(it).input_ids.numel()
    return first, tokens / (time.perf_counter() - start)


def trainer_tps(steps: int) -> float:
    """Median tokens/s per device of the debug preset over steps 2..steps (step 1 includes warm-up)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "torchtitan.train", "--job.config_file", "train_configs/debug_model.toml",
                        "--training.steps", str(steps), "--metrics.log_freq", "1", f"--job.dump_folder={out}"],
                       cwd=REPO, check=True, capture_output=True)
        rows = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["tps"] for row in rows if row["step"] >= 2)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table (and write it to --output); exit 1 if a configuration misses the 20x margin."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer-tps", type=float, help="trainer tokens/s per device (default: measure it)")
    parser.add_argument("--trainer-steps", type=int, default=8, help="steps of the debug preset to measure")
    parser.add_argument("--batches", type=int, default=60, help="batches timed per configuration")
    parser.add_argument("--output", type=pathlib.Path, help="also write the table to this markdown file")
    args = parser.parse_args(argv)

    load_pydocs_documents("train")  # build the corpus cache outside the timings
    consumed = args.trainer_tps or trainer_tps(args.trainer_steps)
    lines = [
        "# Data pipeline throughput",
        "",
        f"`python benchmarks/data_pipeline.py` on {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}; pydocs, seq_len {SEQ_LEN}, local batch {LOCAL_BATCH}, rank 0's loader.",
        "",
        f"Trainer, debug model (1 process): {consumed:,.0f} tokens/s per device.",
        "",
        "| source | workers | dp | first batch (s) | tokens/s to this rank | x trainer | x on-the-fly |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = float("inf")
    on_the_fly: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory() as folder:
        shards = str(pathlib.Path(folder) / "pydocs_tokens")
        subprocess.run([sys.executable, "scripts/tokenize_dataset.py", "--dataset", "pydocs", "--output", shards],
                       cwd=REPO, check=True, capture_output=True)
        sources = [("text, tokenizer.model", "tokenizer.model", None), ("text, tokenizer.json", "tokenizer.json", None),
                   ("tokens (shards)", "tokenizer.model", shards)]
        for name, tokenizer_file, path in sources:
            for num_workers in (0, 2):
                for dp in (1, 4):
                    first, delivered = pipeline_tps(tokenizer_file, num_workers, dp, args.batches // dp, path)
                    worst = min(worst, delivered / consumed)
                    if path is None:
                        on_the_fly[num_workers, dp] = max(on_the_fly.get((num_workers, dp), 0.0), delivered)
                    speedup = f"{delivered / on_the_fly[num_workers, dp]:.1f}x" if path else ""
                    lines.append(f"| {name} | {num_workers} | {dp} | {first:.2f} | {delivered:,.0f} | "
                                 f"{delivered / consumed:.0f}x | {speedup} |")
                    print(lines[-1], flush=True)
    lines += ["", f"Lowest margin: {worst:.0f}x (required: {REQUIRED_RATIO}x)."]
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0 if worst >= REQUIRED_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
