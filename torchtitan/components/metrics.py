"""Training metrics: the console line and metrics.jsonl, with throughput and MFU."""

import json
import resource
import sys
import time
from pathlib import Path

import torch

from torchtitan.config.job_config import Metrics as MetricsConfig
from torchtitan.log import logger

# Dense bf16 peak TFLOP/s per device, from vendors' data sheets (no sparsity).
PEAK_BF16_TFLOPS = {
    "A100": 312.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H200": 989.0,
    "B200": 2250.0,
    "MI300X": 1307.0,
    "MI325X": 1307.0,
    "L40S": 362.0,
}


def device_peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's peak, from the override or the table; None (MFU not reported) when unknown."""
    if override is not None:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        # Longest key first so "H100 PCIe" wins over "H100".
        for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
            if key in name:
                return PEAK_BF16_TFLOPS[key]
        logger.warning(f"unknown GPU '{name}': MFU is not reported; set metrics.peak_tflops to enable it")
        return None
    logger.warning(f"no known peak for device '{device.type}': MFU is not reported; set metrics.peak_tflops")
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: device memory reserved on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Writes one console line and one metrics.jsonl row per logged step."""

    def __init__(self, cfg: MetricsConfig, dump_folder: str, rank: int, device: torch.device,
                 flops_per_token: float):
        self.cfg = cfg
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak_tflops = device_peak_tflops(device, cfg.peak_tflops)
        self.writes = rank == 0 or cfg.save_for_all_ranks
        self.color = not cfg.disable_color_printing and sys.stdout.isatty()
        self.jsonl = None
        if self.writes:
            name = "metrics.jsonl" if rank == 0 else f"metrics_rank{rank}.jsonl"
            path = Path(dump_folder) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = path.open("a")
        self.start = self.last_time = time.perf_counter()
        self.tokens_since_log = 0

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0 or step == last_step

    def count_tokens(self, local_tokens: int) -> None:
        self.tokens_since_log += local_tokens

    def reset_clock(self) -> None:
        """Start timing from now (e.g. after the first, compile-heavy step)."""
        self.last_time = time.perf_counter()
        self.tokens_since_log = 0

    def log(self, step: int, loss: float, grad_norm: float, lr: float) -> dict:
        now = time.perf_counter()
        tps = self.tokens_since_log / max(now - self.last_time, 1e-9)
        tflops = tps * self.flops_per_token / 1e12
        mfu = 100.0 * tflops / self.peak_tflops if self.peak_tflops else None
        row = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": round(tps, 1),
            "tflops": round(tflops, 4),
            "mfu": None if mfu is None else round(mfu, 3),
            "memory_gib": round(memory_gib(self.device), 3),
            "elapsed_s": round(now - self.start, 3),
        }
        self.last_time, self.tokens_since_log = now, 0
        if self.writes:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
            logger.info(self._console_line(row))
        return row

    def _console_line(self, row: dict) -> str:
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.2f}%"
        fields = [
            ("step", f"{row['step']}", "\033[31m"),
            ("loss", f"{row['loss']:.4f}", "\033[32m"),
            ("grad_norm", f"{row['grad_norm']:.4f}", "\033[33m"),
            ("lr", f"{row['lr']:.3e}", "\033[34m"),
            ("memory", f"{row['memory_gib']:.2f} GiB", "\033[36m"),
            ("tps", f"{row['tps']:,.0f}", "\033[35m"),
            ("tflops", f"{row['tflops']:.2f}", "\033[36m"),
            ("mfu", mfu, "\033[32m"),
        ]
        reset = "\033[0m"
        return "  ".join(f"{c}{k}: {v}{reset}" if self.color else f"{k}: {v}" for k, v, c in fields)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
