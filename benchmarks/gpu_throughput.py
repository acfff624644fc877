"""Training throughput on this machine's GPU: tokens/s, MFU and peak memory per configuration, one table.

    python benchmarks/gpu_throughput.py [--steps 25] [--skip 5] [--output benchmarks/results/gpu_throughput.md]

The model is Llama 3 with the 8B flavor's dimensions cut to --layers layers (8; vocabulary 128,256), trained at
batch 1 x 8192 in bf16 with selective per-op activation checkpointing, on the embedded corpus; each configuration
runs in its own process and reports the median over steps --skip+1 .. --steps of the trainer's own metrics
(tokens/s per device, MFU against the device's dense bf16 peak, peak allocated memory). Configurations: eager,
compiled, compiled + float8 tensorwise, compiled + float8 rowwise, compiled without AC, compiled + chunked loss.
--flavor/--layers/--seq_len/--configs make a small run for a machine without a large GPU (or without one);
--json appends each row as one JSON line as it is measured (scripts/gpu_check.py reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile

from report import Table, append_json, environment, figure, median_of

REPO = pathlib.Path(__file__).resolve().parents[1]
COMPILED = ["--compile.enable"]
FLOAT8 = [*COMPILED, "--model.converters", "float8"]
CONFIGS = {
    "eager": [],
    "compiled": COMPILED,
    "compiled + float8 tensorwise": [*FLOAT8, "--quantize.linear.float8.recipe_name", "tensorwise"],
    "compiled + float8 rowwise": [*FLOAT8, "--quantize.linear.float8.recipe_name", "rowwise"],
    "compiled without AC": [*COMPILED, "--activation_checkpoint.mode", "none"],
    "compiled + chunked loss": [*COMPILED, "--training.loss_chunk_size", "2048"],
}
FLAVOR = "bench"  # registered in the training process by --run


def run_config(args, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        argv = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", FLAVOR,
                "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "1",
                "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
                "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
                f"--job.dump_folder={dump}", *flags]
        command = [sys.executable, __file__, "--run", json.dumps({"flavor": args.flavor, "layers": args.layers,
                                                                   "argv": argv})]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            lines = (result.stderr or result.stdout).strip().splitlines()
            return {"error": lines[-1] if lines else f"exit {result.returncode}"}
        rows = [json.loads(line) for line in (pathlib.Path(dump) / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if "tps" in r and r["step"] > args.skip]
    return {key: median_of(kept, key) for key in ("tps", "mfu", "memory_gib", "loss")}


def table_row(name: str, result: dict) -> str:
    if "error" in result:
        return f"| {name} | failed: {result['error'][:120]} | | | |"
    return (f"| {name} | {figure(result['tps'], ',.0f')} | {figure(result['mfu'], '.1f')} | "
            f"{figure(result['memory_gib'], '.1f')} | {figure(result['loss'], '.3f')} |")


def train_with_flavor(spec: dict) -> int:
    """In the training process: register the benchmark flavor, then train."""
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.train import main

    llama3_flavors[FLAVOR] = dataclasses.replace(llama3_flavors[spec["flavor"]], n_layers=spec["layers"])
    return main(spec["argv"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--skip", type=int, default=5, help="leading steps left out (warm-up, compilation)")
    parser.add_argument("--flavor", default="8B", help="llama3 flavor whose dimensions are used")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    parser.add_argument("--output", type=pathlib.Path, help="also write the table (markdown) here")
    parser.add_argument("--json", type=pathlib.Path, help="also append each row here as one JSON line, as measured")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return train_with_flavor(json.loads(args.run))
    names = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
    table = Table([
        "# Training throughput",
        "",
        f"`python benchmarks/gpu_throughput.py`: llama3 {args.flavor} dimensions, {args.layers} layers, batch 1 x "
        f"{args.seq_len}, bf16, selective per-op AC unless noted; median of steps {args.skip + 1}-{args.steps}.",
        f"Environment: {environment()}.",
        "",
        "| configuration | tokens/s | MFU (%) | peak memory (GiB) | loss |",
        "|---|---|---|---|---|",
    ], args.output)
    for name in names:
        result = run_config(args, CONFIGS[name])
        append_json(args.json, {"configuration": name, "layers": args.layers, "seq_len": args.seq_len, **result})
        table.add(table_row(name, result))
    table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
