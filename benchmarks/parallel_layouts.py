"""Throughput and peak memory of each parallel layout on 2 CPU processes, against 1 process.

Every layout trains the debug model on the same global batch; the numbers come from the runs'
own metrics.jsonl (tokens/s per device, peak memory of rank 0), averaged over the steps after the
first (which includes start-up and, with compile, compilation).

    python benchmarks/parallel_layouts.py [--steps 8] [--seq 512] [--output benchmarks/results/parallel_layouts.md]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYOUTS = [
    ("1 process", 1, ["--training.local_batch_size", "8"]),
    ("FSDP 2", 2, ["--training.local_batch_size", "4"]),
    ("DDP 2", 2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"]),
    ("TP 2", 2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    ("FSDP 2 + selective op AC", 2, ["--training.local_batch_size", "4", "--activation_checkpoint.mode",
                                     "selective", "--activation_checkpoint.selective_ac_option", "op"]),
]


def run_layout(nproc: int, flags: list[str], steps: int, seq: int, dump: Path) -> list[dict]:
    env = {**os.environ, "NGPU": str(nproc), "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    cmd = ["./run_train.sh", "--training.steps", str(steps), "--training.seq_len", str(seq),
           "--metrics.log_freq", "1", f"--job.dump_folder={dump}", *flags]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--output", default="benchmarks/results/parallel_layouts.md")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, nproc, flags) in enumerate(LAYOUTS):
            metrics = run_layout(nproc, flags, args.steps, args.seq, Path(tmp) / str(i))
            tps = statistics.mean(r["tps"] for r in metrics[1:])
            rows.append((name, nproc, tps, tps * nproc, max(r["memory_gib"] for r in metrics)))
            print(f"{name}: {tps:,.0f} tokens/s per device", flush=True)

    base = rows[0][3]
    lines = [
        f"# Parallel layouts on CPU: debug model, global batch 8 x {args.seq}, bf16 compute, gloo",
        "",
        f"{args.steps} steps per layout, mean over steps 2..{args.steps}; memory is rank 0's peak resident set "
        "(the CPU has no device-memory counter). Both processes share the same 2 cores, so 2-process "
        "layouts measure overhead and memory, not speed-up.",
        "",
        "| layout | processes | tokens/s per device | tokens/s aggregate | vs 1 process | peak memory (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {p} | {t:,.0f} | {a:,.0f} | {a / base:.2f}x | {m:.2f} |" for n, p, t, a, m in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
