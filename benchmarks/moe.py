"""Mixture-of-Experts throughput: the grouped-GEMM and loop expert paths, and expert parallelism 1 vs 2.

1. The experts alone: forward + backward of the routed experts (GroupedExperts) on each path, at the debug
   model's widths and at Qwen3-30B-A3B's (16 local experts, as under EP 8), in each dtype this device runs.
2. The trainer: qwen3_moe debugmodel on one process, and on two as FSDP 2 without and with EP 2, on each expert
   path; tokens/s per device from the runs' own metrics (median of the steps after the first two).
3. On a CUDA machine also Qwen3-30B-A3B's dimensions with 4 layers, batch 1 x 8192, selective per-op AC, bf16,
   AdamW, eager and compiled: tokens/s, MFU counted on active parameters, peak memory.

    python benchmarks/moe.py [--steps 8] [--output benchmarks/results/moe.md]

``--experts E,DIM,HIDDEN,ROWS`` (repeatable) times only the routed experts of those shapes and prints their
rows, e.g. the loop path at 64 experts on one thread:

    python benchmarks/moe.py --threads 1 --experts 64,256,768,8192

``--sections`` picks among the three parts above; ``--gpu_layers``, ``--gpu_seq_len`` and ``--gpu_modes`` size the
third to a smaller GPU, and ``--json`` appends every row as one JSON line as it is measured (scripts/gpu_check.py
runs ``--sections experts,gpu`` this way).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from report import append_json, figure, median_of  # noqa: E402

from torchtitan.components.expert_load import time_expert_paths  # noqa: E402
from torchtitan.hardware import cpu_model  # noqa: E402

# (label, local experts, dim, expert width, routed rows)
SHAPES = [("debugmodel", 8, 64, 32, 8 * 256 * 2), ("30B-A3B widths, 16 local experts", 16, 2048, 768, 2048 * 8)]
SECTIONS = ("experts", "trainer", "gpu")
GPU_MODES = {"eager": ["--compile.no_enable"], "compiled": ["--compile.enable"]}
GPU_LAYERS = (1, 2, 3, 4)  # the 30B-A3B cuts benchmarks/moe_flavors.py registers


def dtypes_to_time(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        return [torch.bfloat16]  # the grouped kernel's CUDA dtype
    from torchtitan.distributed.precision import cpu_computes_bf16_fast

    # Without fast bfloat16 (an AVX2-only CPU) a bf16 matmul is ~40x slower than fp32: not worth timing.
    return [torch.float32, torch.bfloat16] if cpu_computes_bf16_fast() else [torch.float32]


def run_trainer(nproc: int, flags: list[str], dump: Path) -> list[dict]:
    env = {**os.environ, "PYTHON": sys.executable}
    launcher = [sys.executable, "-m", "torchtitan.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend", "c10d",
        "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train"]
    result = subprocess.run([*launcher, *flags, f"--job.dump_folder={dump}"], cwd=REPO, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{flags} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", default="benchmarks/results/moe.md")
    parser.add_argument("--experts", action="append", default=[], metavar="E,DIM,HIDDEN,ROWS",
                        help="time only the routed experts of this shape (repeatable); prints, writes nothing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per path (the best is kept)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: "
                        + ", ".join(SECTIONS) + " (the parts 1-3 above; gpu runs only on a CUDA machine)")
    parser.add_argument("--gpu_layers", type=int, default=4, choices=GPU_LAYERS,
                        help="layers of the Qwen3-30B-A3B cut in the one-GPU section")
    parser.add_argument("--gpu_seq_len", type=int, default=8192, help="sequence length of the one-GPU section")
    parser.add_argument("--gpu_modes", default=",".join(GPU_MODES),
                        help="comma-separated subset of: " + ", ".join(GPU_MODES) + " (the one-GPU section's rows)")
    parser.add_argument("--json", type=Path, help="also append each row here as one JSON line, as measured")
    args = parser.parse_args()
    sections = [name.strip() for name in args.sections.split(",")]
    modes = [name.strip() for name in args.gpu_modes.split(",")]
    for flag, names, valid in (("--sections", sections, SECTIONS), ("--gpu_modes", modes, GPU_MODES)):
        if not names or any(name not in valid for name in names):
            parser.error(f"{flag} {','.join(names)!r}: each must be one of {', '.join(valid)}")
    if args.gpu_seq_len < 1:
        parser.error(f"--gpu_seq_len {args.gpu_seq_len}: must be a positive number of tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"{cpu_model()}, {threads} threads"
    if args.experts:
        print(f"# routed experts on {name} (torch {torch.__version__}), best of {args.repeats}")
        for spec in args.experts:
            experts, dim, hidden, rows = (int(v) for v in spec.split(","))
            for line in expert_rows(f"{experts} experts", experts, dim, hidden, rows, device, args.repeats, args.json):
                print(line, flush=True)
        return
    # The trainer runs first: a child process inherits its parent's peak resident set on Linux, and the expert
    # timings below grow this one's to gigabytes.
    trainer_lines = trainer_section(args, sections, modes)
    lines = [f"# MoE benchmarks on {name} (torch {torch.__version__})"]
    if "experts" in sections:
        lines += ["", "## Routed experts alone (forward + backward, tokens spread evenly; best of 5)", "",
                  "| shape | dtype | routed rows | grouped GEMM (ms) | loop (ms) | loop / grouped |",
                  "|---|---|---|---|---|---|"]
        for label, experts, dim, hidden, rows in SHAPES:
            for line in expert_rows(label, experts, dim, hidden, rows, device, 5, args.json):
                lines.append(line)
                print(line, flush=True)
    lines += trainer_lines
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)


def expert_rows(label: str, experts: int, dim: int, hidden: int, rows: int, device: torch.device,
                repeats: int, json_path: Path | None) -> list[str]:
    """One table row per dtype: both expert paths' best forward + backward time."""
    lines = []
    for dtype in dtypes_to_time(device):
        timings = time_expert_paths(experts, dim, hidden, rows, dtype, device, repeats=repeats)
        grouped, loop = timings["grouped"], timings["loop"]
        append_json(json_path, {"section": "experts", "shape": f"{label} ({experts} x {dim} x {hidden})",
                                "dtype": str(dtype)[6:], "rows": rows, "grouped_ms": grouped * 1e3,
                                "loop_ms": loop * 1e3})
        lines.append(f"| {label} ({experts} x {dim} x {hidden}) | {str(dtype)[6:]} | {rows:,} | "
                     f"{grouped * 1e3:.2f} | {loop * 1e3:.2f} | {loop / grouped:.2f}x |")
    return lines


def trainer_section(args, sections: list[str], modes: list[str]) -> list[str]:
    """The trainer's rows: part 2 (where asked for) and, on a CUDA machine, part 3."""
    with tempfile.TemporaryDirectory() as tmp:
        lines = debug_trainer_rows(args.steps, Path(tmp), args.json) if "trainer" in sections else []
        if "gpu" in sections and torch.cuda.is_available():
            lines += gpu_section(Path(tmp), args, modes)
    return lines


def debug_trainer_rows(steps: int, tmp: Path, json_path: Path | None) -> list[str]:
    common = ["--job.config_file", "train_configs/qwen3_moe_debug.toml", "--training.steps", str(steps),
              "--metrics.log_freq", "1"]
    layouts = [("1 process", 1, ["--training.local_batch_size", "8"]),
               ("FSDP 2, EP 1", 2, ["--training.local_batch_size", "4"]),
               ("FSDP 2, EP 2", 2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"])]
    lines = ["", f"## Trainer: qwen3_moe debugmodel, global batch 8 x 256, {steps} steps (median of steps 3+)", "",
             "Two processes share the machine's cores, so they show the overhead of each layout, not a speed-up.", "",
             "| layout | expert path | tokens/s per device | tokens/s aggregate | peak memory (GiB) |",
             "|---|---|---|---|---|"]
    for i, (label, nproc, flags) in enumerate(layouts):
        for path in ("grouped", "loop"):
            if torch.cuda.is_available() and nproc > torch.cuda.device_count():
                lines.append(f"| {label} | {path} | needs {nproc} GPUs; this machine has "
                             f"{torch.cuda.device_count()} | | |")
                continue
            rows = run_trainer(nproc, [*common, *flags, "--moe.expert_compute", path], tmp / f"{i}{path}")
            tps = steady(rows, "tps")
            memory = max(r["memory_gib"] for r in rows)
            append_json(json_path, {"section": "trainer", "layout": label, "path": path, "tps": tps,
                                    "memory_gib": memory})
            lines.append(f"| {label} | {path} | {tps:,.0f} | {tps * nproc:,.0f} | {memory:.2f} |")
            print(lines[-1], flush=True)
    return lines


def gpu_section(tmp: Path, args, modes: list[str]) -> list[str]:
    """Qwen3-30B-A3B widths cut to --gpu_layers layers, one GPU (benchmarks/moe_flavors.py registers the flavor)."""
    layers, seq_len = args.gpu_layers, args.gpu_seq_len
    lines = ["", f"## One GPU: Qwen3-30B-A3B widths, {layers} layers, batch 1 x {seq_len}, selective per-op AC, bf16, "
             "AdamW", "", "| mode | tokens/s | MFU (active parameters) | peak memory (GiB) |", "|---|---|---|---|"]
    base = ["--job.config_file", "train_configs/qwen3_moe_30b_a3b.toml", "--experimental.custom_import",
            "benchmarks.moe_flavors", "--model.flavor", f"30B-A3B-{layers}layers", "--model.hf_assets_path",
            "assets/tokenizer", "--training.local_batch_size", "1", "--training.seq_len", str(seq_len),
            "--training.steps", str(max(args.steps, 25)), "--parallelism.expert_parallel_degree", "1",
            "--metrics.log_freq", "1", "--training.mixed_precision_param", "bfloat16"]
    for mode in modes:
        rows = run_trainer(1, [*base, *GPU_MODES[mode]], tmp / f"gpu_{mode}")
        window = rows[5:25]
        tps, mfu = median_of(window, "tps"), median_of(window, "mfu")
        memory = max(r["memory_gib"] for r in rows)
        append_json(args.json, {"section": "gpu", "mode": mode, "layers": layers, "seq_len": seq_len, "tps": tps,
                                "mfu": mfu, "memory_gib": memory})
        percent = "n/a" if mfu is None else f"{mfu:.1f}%"
        lines.append(f"| {mode} | {figure(tps, ',.0f')} | {percent} | {memory:.1f} |")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
