"""What each part of scripts/gpu_check.py runs and how its figures are read back: the CUDA tier, the dense and
MoE throughput rows (sized to the GPU's free memory), fla against the chunked kernel and the two-GPU NCCL run.

Standard library only, as gpu_check.py: the parts' own processes import torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# --- Sizing the throughput rows to the GPU's memory ---------------------------------------------------------------

@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of one training process (bf16 compute, fp32 weights, gradients and AdamW states: 16 bytes a
    parameter) as fixed + per_layer x layers + activations x seq_len / 8192, calibrated on the reference runs."""

    fixed_gib: float  # embedding and output weights with their gradients and optimizer states
    per_layer_gib: float
    activations_gib: float  # at 8192 tokens (saved activations, logits), from the measured peaks
    max_layers: int  # the reference runs' layers: more would not compare with benchmarks/results


# Llama 3 8B widths, 218 M parameters a layer, 1.05 G in the vocabulary; measured 44.2-45.9 GiB compiled at 8 layers
# (benchmarks/results/gpu_throughput_h200.md, ../shared/reference/gpu.md).
DENSE = MemoryModel(fixed_gib=15.65, per_layer_gib=3.25, activations_gib=4.6, max_layers=8)
# Qwen3-30B-A3B widths, 623 M parameters a layer, 0.62 G in the vocabulary; 53.6 GiB compiled at 4 layers
# (benchmarks/results/moe_h200.md).
MOE = MemoryModel(fixed_gib=9.27, per_layer_gib=9.28, activations_gib=7.4, max_layers=4)
SEQ_LENS = (8192, 4096, 2048)


@dataclass(frozen=True)
class Sizing:
    layers: int
    seq_len: int
    estimate_gib: float


def usable_gib(free_gib: float) -> float:
    """What a run may plan to peak at: a tenth and a GiB kept back for the CUDA context, the allocator's slack and
    the error of the memory model."""
    return free_gib * 0.9 - 1.0


def size_rows(model: MemoryModel, free_gib: float) -> Sizing | None:
    """The most layers (up to the reference's) that fit at the longest sequence that fits; None if none does."""
    usable = usable_gib(free_gib)
    for seq_len in SEQ_LENS:
        base = model.fixed_gib + model.activations_gib * seq_len / 8192
        layers = min(model.max_layers, math.floor((usable - base) / model.per_layer_gib))
        if layers >= 1:
            return Sizing(layers, seq_len, base + layers * model.per_layer_gib)
    return None


# --- The machine, as the probe found it ----------------------------------------------------------------------------

@dataclass
class Machine:
    python: str
    env: dict
    info: dict  # the probe's
    notes: dict = field(default_factory=dict)  # report lines about the set-up: wheels, driver, tree, logs

    @property
    def gpus(self) -> list[dict]:
        return self.info.get("gpus", [])

    def package(self, dist: str) -> str | None:
        """The installed version, None when it does not import."""
        return self.info.get("packages", {}).get(dist, {}).get("version")

    @property
    def float8(self) -> bool:
        return bool(self.gpus) and tuple(self.gpus[0]["capability"]) >= (8, 9) and self.package("torchao") is not None

    def sizing(self, model: MemoryModel) -> Sizing | None:
        return size_rows(model, self.gpus[0]["free_gib"]) if self.gpus else None


# --- The parts --------------------------------------------------------------------------------------------------------

@dataclass
class Part:
    title: str
    what: Callable[[Machine | None], str]  # one line for the plan (None: no GPU here)
    reserve: float  # seconds planned for it at the default budget
    minimum: float  # with less than this left it is skipped
    skip_reason: Callable[[Machine], str | None]
    command: Callable[[Machine, Path], list[str]]  # given its work folder
    figures: Callable[[Machine, Path, str], tuple[list[str], list[str]]]  # (markdown lines, problems) from its
    # work folder and output


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def pytest_workers(machine: Machine) -> int:
    """pytest-xdist workers on the one GPU: one per 26 GiB (the tier's 1.1B-model tests peak near 25 GiB each),
    at most 4 and at most the cores."""
    if machine.package("pytest-xdist") is None:
        return 0
    return max(1, min(4, os.cpu_count() or 1, int(machine.gpus[0]["total_gib"] // 26)))


def cuda_tier_command(machine: Machine, work: Path) -> list[str]:
    workers = pytest_workers(machine)
    # Without pytest-xdist the project's "-n auto" in addopts would be an unknown option.
    parallel = ["-n", str(workers)] if workers > 1 else ["-n", "0"] if workers else ["-o", "addopts=-ra"]
    return [machine.python, "-m", "pytest", "-m", "cuda", "tests/cuda", "-v", "-p", "no:cacheprovider",
            "--durations=0", "--durations-min=1", *parallel]


OUTCOME = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"


def pytest_figures(output: str) -> tuple[list[str], list[str]]:
    """Each test's outcome and call time, the summary line and the short summary (failures', skips' reasons)."""
    outcomes, seconds = {}, {}
    for line in output.splitlines():
        if m := re.match(rf"^\[gw\d+\] \[\s*\d+%\] {OUTCOME} (\S+)", line):
            outcomes[m[2]] = m[1]
        elif m := re.match(rf"^(tests/\S+::\S+) {OUTCOME}", line):
            outcomes[m[1]] = m[2]
        elif m := re.match(r"^\s*([\d.]+)s call\s+(\S+)", line):
            seconds[m[2]] = float(m[1])
    summary = [line.strip("= ") for line in output.splitlines() if re.match(r"^=+ .*\bin [\d.]+s", line)]
    short = output.split("short test summary info", 1)[1].splitlines()[1:] if "short test summary info" in output \
        else []
    short = [line for line in short if re.match(r"^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)", line)]
    lines = [f"pytest: {summary[-1] if summary else 'no summary line (cut short?)'}", ""]
    if outcomes:
        lines += ["| test | outcome | call (s) |", "|---|---|---|"]
        lines += [f"| `{test}` | {outcome} | {fmt(seconds.get(test), '.1f')} |" for test, outcome in outcomes.items()]
    if short:
        lines += ["", "Short summary:", "", *(f"- {line}" for line in short)]
    problems = [f"{test} {outcome}" for test, outcome in outcomes.items() if outcome in ("FAILED", "ERROR", "XPASS")]
    return lines, problems


def dense_configs(machine: Machine | None) -> list[str]:
    return ["compiled", "compiled + float8 tensorwise"] if machine is None or machine.float8 else ["compiled"]


def sizing_text(machine: Machine | None, model: MemoryModel) -> str:
    if machine is None or not machine.gpus:
        return "layers and sequence from the free GPU memory"
    sized = machine.sizing(model)
    free = machine.gpus[0]["free_gib"]
    if sized is None:
        return f"nothing fits {free:.1f} GiB free"
    return (f"{sized.layers} layers x {sized.seq_len} tokens (estimated peak {sized.estimate_gib:.1f} GiB of "
            f"{free:.1f} GiB free)")


def too_small(machine: Machine, model: MemoryModel) -> str | None:
    if machine.sizing(model) is not None:
        return None
    least = model.fixed_gib + model.activations_gib * SEQ_LENS[-1] / 8192 + model.per_layer_gib
    return (f"{machine.gpus[0]['free_gib']:.1f} GiB free; one layer at {SEQ_LENS[-1]} tokens needs about "
            f"{least:.0f} GiB with room to spare")


def dense_command(machine: Machine, work: Path) -> list[str]:
    sized = machine.sizing(DENSE)
    return [machine.python, "benchmarks/gpu_throughput.py", "--configs", ",".join(dense_configs(machine)),
            "--layers", str(sized.layers), "--seq_len", str(sized.seq_len), "--steps", "10", "--skip", "4",
            "--json", str(work / "rows.jsonl"), "--output", str(work / "table.md")]


def dense_figures(machine: Machine, work: Path, output: str) -> tuple[list[str], list[str]]:
    rows = {row["configuration"]: row for row in read_jsonl(work / "rows.jsonl")}
    lines = [f"Llama 3 8B widths, {sizing_text(machine, DENSE)}, batch 1, selective per-op AC, bf16; median of "
             "steps 5-10.", "", "| configuration | tokens/s | MFU (%) | peak memory (GiB) | loss |",
             "|---|---|---|---|---|"]
    problems = []
    for name in dense_configs(machine):
        row = rows.get(name)
        if row is None:
            lines.append(f"| {name} | not measured | | | |")
            problems.append(f"{name}: not measured")
        elif "error" in row:
            lines.append(f"| {name} | failed: {row['error'][:160]} | | | |")
            problems.append(f"{name}: {row['error'][:160]}")
        else:
            lines.append(f"| {name} | {fmt(row['tps'], ',.0f')} | {fmt(row['mfu'], '.1f')} | "
                         f"{fmt(row['memory_gib'], '.1f')} | {fmt(row['loss'], '.3f')} |")
    if not machine.float8:
        lines += ["", "float8 left out: it needs compute capability 8.9 or newer and torchao."]
    return lines, problems


def moe_command(machine: Machine, work: Path) -> list[str]:
    sized = machine.sizing(MOE)
    return [machine.python, "benchmarks/moe.py", "--sections", "experts,gpu", "--gpu_modes", "compiled",
            "--gpu_layers", str(sized.layers), "--gpu_seq_len", str(sized.seq_len), "--json",
            str(work / "rows.jsonl"), "--output", str(work / "table.md")]


def moe_figures(machine: Machine, work: Path, output: str) -> tuple[list[str], list[str]]:
    rows = read_jsonl(work / "rows.jsonl")
    lines = [f"One GPU, Qwen3-30B-A3B widths, {sizing_text(machine, MOE)}, batch 1, selective per-op AC, bf16, "
             "AdamW, compiled (float8 would reach only the attention's Linears here, not the grouped experts):", "",
             "| mode | tokens/s | MFU (active parameters, %) | peak memory (GiB) |", "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {fmt(r['tps'], ',.0f')} | {fmt(r['mfu'], '.1f')} | {fmt(r['memory_gib'], '.1f')} |"
              for r in rows if r["section"] == "gpu"]
    lines += ["", "Routed experts alone, forward + backward, best of 5:", "",
              "| shape | dtype | routed rows | grouped GEMM (ms) | loop (ms) |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['dtype']} | {r['rows']:,} | {r['grouped_ms']:.2f} | {r['loop_ms']:.2f} |"
              for r in rows if r["section"] == "experts"]
    problems = [] if any(r["section"] == "gpu" for r in rows) else ["no one-GPU row measured"]
    return lines, problems


def fla_figures(machine: Machine, work: Path, output: str) -> tuple[list[str], list[str]]:
    rows = read_jsonl(work / "rows.jsonl")
    parity = [r for r in rows if r["check"] == "parity"]
    lines = [f"{parity[0]['shape'] if parity else 'one Qwen3-Next layer'}; float32 inputs for parity:", "",
             "| tensor | max difference / max magnitude |", "|---|---|"]
    lines += [f"| {r['tensor']} | {r['relative_error']:.2e} |" for r in parity]
    lines += ["", "| kernel (v in bf16) | forward + backward (ms) | tokens/s |", "|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} |" for r in rows if r["check"] == "time"]
    problems = [f"{r['tensor']} differs by {r['relative_error']:.1e} (> {r['tolerance']:g})" for r in parity
                if r["relative_error"] > r["tolerance"]]
    return lines, problems


# The two-GPU runs: the debug model, then QLoRA on it (its NF4 base sharded by FSDP: the path that has run on CPU only).
NCCL_RUNS = {"run": [], "qlora": ["--model.converters", "lora", "--lora.base_dtype", "nf4", "--lora.targets",
                                  "attention.*,feed_forward.*", "--optimizer.lr", "1e-2"]}


def nccl_command(machine: Machine, work: Path) -> list[str]:
    runs = [shlex.join([machine.python, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend", "c10d",
                        "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train", "--job.config_file",
                        "train_configs/debug_model.toml", "--training.steps", "10", "--metrics.log_freq", "1",
                        f"--job.dump_folder={work / name}", *flags]) for name, flags in NCCL_RUNS.items()]
    return ["sh", "-c", " && ".join(runs)]


def nccl_figures(machine: Machine, work: Path, output: str) -> tuple[list[str], list[str]]:
    lines, problems = [], []
    for name, what in (("run", "Llama 3 debug model"), ("qlora", "QLoRA on it (NF4 base sharded)")):
        rows = [r for r in read_jsonl(work / name / "metrics.jsonl") if "loss" in r]
        if not rows:
            lines.append(f"{what}: no metrics rows.")
            problems.append(f"{name}: no metrics rows")
            continue
        losses = [r["loss"] for r in rows]
        tps = statistics.median(r["tps"] for r in rows[2:] or rows)
        lines.append(f"{what}, FSDP over 2 GPUs, {len(rows)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                     f"{tps:,.0f} tokens/s per GPU (median of steps 3+), peak memory "
                     f"{max(r['memory_gib'] for r in rows):.2f} GiB.")
        if not (all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]):
            problems.append(f"{name}: the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")
    return lines, problems


def fla_skip(machine: Machine) -> str | None:
    if machine.package("fla-core") is None:
        error = machine.info.get("packages", {}).get("fla-core", {}).get("error", "")
        return f"fla is not importable ({error})"
    return None


PARTS = [
    Part("CUDA tier", lambda m: "pytest -m cuda tests/cuda (training modes, float8, checkpoints, HF export, NCCL "
         "one-process, kernels)", 150, 60,
         lambda m: None if m.package("pytest") else "pytest is not importable (bring its wheel in .gpu/whl)",
         cuda_tier_command, lambda m, work, output: pytest_figures(output)),
    Part("dense throughput", lambda m: f"benchmarks/gpu_throughput.py {' and '.join(dense_configs(m))}"
         f"{'' if m else ' (float8 on compute capability >= 8.9)'}, {sizing_text(m, DENSE)}", 130, 75,
         lambda m: too_small(m, DENSE), dense_command, dense_figures),
    Part("MoE throughput", lambda m: f"benchmarks/moe.py --sections experts,gpu, compiled, {sizing_text(m, MOE)}",
         90, 60, lambda m: too_small(m, MOE), moe_command, moe_figures),
    Part("fla against the chunked kernel", lambda m: "benchmarks/gated_delta_rule.py (parity and times), if fla "
         "is importable", 40, 25, fla_skip,
         lambda m, work: [m.python, "benchmarks/gated_delta_rule.py", "--json", str(work / "rows.jsonl")], fla_figures),
    Part("NCCL, two processes", lambda m: "torchrun --nproc_per_node 2, the debug model 10 steps (FSDP), then QLoRA "
         "on it 10 steps (its NF4 base sharded), if two GPUs are present", 40, 25,
         lambda m: None if len(m.gpus) >= 2 else f"this machine has {len(m.gpus)} GPU", nccl_command, nccl_figures),
]
