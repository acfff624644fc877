"""DiLoCo against synchronising every step: final loss and the bytes each replica group sends per step.

Two replica groups of FSDP 2 (4 processes, CPU/gloo) train the tiny Llama 3 with AdamW: plain HSDP 2 x 2, the
fault-tolerant groups synchronising every step, and DiLoCo with H = sync_every inner steps (outer SGD, Nesterov).

    python benchmarks/diloco.py [--steps 300] [--sync_every 20] [--output benchmarks/results/diloco_cpu.md]

Bytes per step are measured by the trainer (ft/sent_bytes_per_step: what a group contributes to the cross-group
reductions, summed over its ranks); HSDP's replicas exchange the same gradients as the every-step groups.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.hardware import cpu_model  # noqa: E402


def torchrun(nproc: int, args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                 "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train",
                                 *args], cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def wait(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    for proc, log in zip(procs, logs):
        if proc.wait() != 0:
            raise SystemExit(f"{log} failed:\n{log.read_text()[-3000:]}")


def run_groups(folder: Path, common: list[str], extra: list[str]) -> list[list[dict]]:
    folder.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "2",
                                   "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
        logs = [folder / f"group{r}.log" for r in (0, 1)]
        procs = [torchrun(2, [*common, *extra, "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                              "--fault_tolerance.replica_id", str(r), f"--job.dump_folder={folder}"], env, log)
                 for r, log in zip((0, 1), logs)]
        wait(procs, logs)
    finally:
        lighthouse.kill()
    return [rows(folder / f"replica_{r}") for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync_every", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/diloco_cpu.md")
    args = parser.parse_args()
    common = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", str(args.steps),
              "--training.seq_len", "128", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "20",
              "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log = tmp / "hsdp.log"
        wait([torchrun(4, [*common, "--parallelism.data_parallel_replicate_degree", "2",
                           f"--job.dump_folder={tmp / 'hsdp'}"], {}, log)], [log])
        results["HSDP 2 x 2 (plain)"] = [rows(tmp / "hsdp")]
        results["2 groups, every step"] = run_groups(tmp / "every", common, [])
        results[f"2 groups, DiLoCo H = {args.sync_every}"] = run_groups(
            tmp / "diloco", common, ["--fault_tolerance.semi_sync.method", "diloco",
                                     "--fault_tolerance.semi_sync.sync_every", str(args.sync_every)])
    every = statistics.mean(r["ft/sent_bytes_per_step"] for r in results["2 groups, every step"][0])
    lines = [f"# DiLoCo vs every-step synchronisation ({cpu_model()}; tiny Llama 3, 2 groups x FSDP 2 on CPU/gloo, "
             f"global batch 8 x 128 tokens, AdamW, {args.steps} steps)", "",
             "| run | loss at step 1 | final loss (mean of the last 10 steps) | bytes a group sends per step |",
             "|---|---|---|---|"]
    for label, groups in results.items():
        first = statistics.mean(g[0]["loss"] for g in groups)
        final = statistics.mean(r["loss"] for g in groups for r in g[-10:])
        if "ft/sent_bytes_per_step" in groups[0][0]:
            sent = statistics.mean(r["ft/sent_bytes_per_step"] for g in groups for r in g)
            measured = f"{sent / 1e6:.2f} MB ({every / sent:.1f}x fewer)" if "DiLoCo" in label else f"{sent / 1e6:.2f} MB"
        else:
            measured = f"{every / 1e6:.2f} MB (its replicas reduce the same gradients)"
        lines.append(f"| {label} | {first:.4f} | {final:.4f} | {measured} |")
    lines += ["", "DiLoCo's groups each score their own batch; their losses are averaged here. The outer optimizer is "
              "SGD with lr 0.7 and Nesterov momentum 0.9 (the DiLoCo paper's)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
