"""Step time against sequence length: the hybrid Qwen3-Next debug model (3 Gated DeltaNet blocks, 1 attention
block) against the same model with attention in every block (flavor debugmodel_attention_only: same width and
depth), and the Kimi Linear debug model (3 Kimi Delta Attention blocks, 1 MLA block, the same width and depth, a
decay per key channel), one process, one sequence per step, causal attention, in the trainer.

    python benchmarks/hybrid_seq_scaling.py [--seq_lens 2048,8192,32768] [--steps 4] [--compile]
        [--output benchmarks/results/hybrid_seq_scaling_cpu.md]

Step time is the median of the steps after the first (which includes warm-up); tokens/s follows from it. The
attention-only model's time grows about quadratically with the sequence (its attention), the hybrid's about
linearly in its three linear blocks.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.hardware import cpu_model  # noqa: E402

# Row label -> (config, flavor).
FLAVORS = {"hybrid (3 linear : 1 attention)": ("train_configs/qwen3_next_debug.toml", "debugmodel"),
           "attention only": ("train_configs/qwen3_next_debug.toml", "debugmodel_attention_only"),
           "Kimi Linear (3 KDA : 1 MLA)": ("train_configs/kimi_linear_debug.toml", "debugmodel")}


def step_time(config: str, flavor: str, seq_len: int, steps: int, compile_model: bool) -> float:
    with tempfile.TemporaryDirectory() as dump:
        flags = ["--job.config_file", config, "--model.flavor", flavor,
                 "--model.attention_mask", "causal", "--training.seq_len", str(seq_len),
                 "--training.local_batch_size", "1", "--training.steps", str(steps), "--metrics.log_freq", "1",
                 f"--job.dump_folder={dump}", *(["--compile.enable"] if compile_model else [])]
        result = subprocess.run([sys.executable, "-m", "torchtitan.train", *flags], cwd=REPO, capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{flags} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_lens", default="2048,8192,32768")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="compile the model (compile.enable)")
    parser.add_argument("--output", default="benchmarks/results/hybrid_seq_scaling_cpu.md")
    args = parser.parse_args()
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    times = {label: [step_time(config, flavor, seq, args.steps, args.compile) for seq in seq_lens]
             for label, (config, flavor) in FLAVORS.items()}
    header = "| model | " + " | ".join(f"seq {s:,}: step s (tok/s)" for s in seq_lens) + " |"
    lines = [f"# Step time vs sequence length, the hybrid debug models ({cpu_model()}, one process, "
             f"{'compiled' if args.compile else 'eager'})", "", header, "|---" * (len(seq_lens) + 1) + "|"]
    for label, row in times.items():
        cells = [f"{t:.3f} ({s / t:,.0f})" for t, s in zip(row, seq_lens)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    growth = {label: row[-1] / row[0] for label, row in times.items()}
    lines += ["", f"From {seq_lens[0]:,} to {seq_lens[-1]:,} tokens ({seq_lens[-1] // seq_lens[0]}x): "
              + "; ".join(f"{label} {g:.1f}x slower" for label, g in growth.items()) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
