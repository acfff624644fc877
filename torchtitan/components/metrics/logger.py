"""Training metrics: one console line and one row per logged step, with throughput, MFU and timing.

Rows go to metrics.jsonl and, when enabled, TensorBoard and W&B; rank 0 only unless
metrics.save_for_all_ranks.
"""

import resource
import sys
import time
from pathlib import Path

import torch

from torchtitan.components.metrics.backends import JsonlBackend, TensorBoardBackend, WandbBackend
from torchtitan.components.metrics.peak_flops import Peak
from torchtitan.config.job_config import Metrics as MetricsConfig
from torchtitan.log import logger


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: device memory reserved on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    def __init__(
        self,
        cfg: MetricsConfig,
        dump_folder: str,
        rank: int,
        device: torch.device,
        compute_dtype: torch.dtype,
        flops_per_token: float,
        total_steps: int,
        run_config: dict | None = None,
        console_extras: tuple[str, ...] = (),
    ):
        """``console_extras``: row keys printed after the loss too (the objective's metrics, e.g. mtp/loss)."""
        self.cfg = cfg
        self.console_extras = console_extras
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = Peak(device, compute_dtype, cfg.peak_tflops)
        self.writes = rank == 0 or cfg.save_for_all_ranks
        self.color = not cfg.disable_color_printing and sys.stdout.isatty()
        self.backends: list = []
        if self.writes:
            folder = Path(dump_folder)
            self.backends.append(JsonlBackend(folder / ("metrics.jsonl" if rank == 0 else f"metrics_rank{rank}.jsonl")))
            if cfg.enable_tensorboard:
                self.backends.append(TensorBoardBackend(folder / cfg.save_tb_folder / f"rank{rank}"))
            if cfg.enable_wandb:
                group = folder.name if cfg.save_for_all_ranks else None
                self.backends.append(WandbBackend(folder, cfg.wandb_project,
                                                  cfg.wandb_run_name, run_config or {}, group))
        self.progress = _ProgressBar(total_steps) if self.writes and sys.stdout.isatty() else None
        self.start = self.last_time = time.perf_counter()
        self._reset_window()

    def _reset_window(self) -> None:
        self.tokens_since_log = 0
        self.steps_since_log = 0
        self.data_seconds = 0.0

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0 or step == last_step

    def record_step(self, step: int, local_tokens: int, data_seconds: float) -> None:
        """Account one finished step: tokens this rank processed and time spent waiting for data."""
        self.tokens_since_log += local_tokens
        self.steps_since_log += 1
        self.data_seconds += data_seconds
        if self.progress is not None:
            self.progress.update(step)

    def log(self, step: int, loss: float, grad_norm: float, lr: float, extra: dict | None = None) -> dict:
        """Write one row; ``extra`` adds a component's own keys (e.g. the MoE expert loads, "moe/...")."""
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        tps = self.tokens_since_log / elapsed
        tflops = tps * self.flops_per_token / 1e12
        mfu = self.peak.mfu(tflops)
        steps = max(self.steps_since_log, 1)
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
            "step_time_s": round(elapsed / steps, 4),
            "data_time_s": round(self.data_seconds / steps, 4),
            "data_pct": round(100.0 * self.data_seconds / elapsed, 2),
            **(extra or {}),
        }
        self.last_time = now
        self._reset_window()
        self._emit(row, self._console_line(row))
        return row

    def log_validation(self, step: int, values: dict) -> None:
        """A validation row: its keys are val_* so no reader mistakes them for the training loss."""
        row = {"step": step, **values}
        self._emit(row, f"validation step: {step}  " + "  ".join(f"{k}: {v:.4f}" for k, v in values.items()))

    def log_eval(self, step: int, values: dict) -> None:
        """A downstream-task row ([eval]): keys eval/{task}/{metric}."""
        self._emit({"step": step, **values}, f"eval step: {step}  " + "  ".join(f"{k}: {v:.4f}" for k, v in
                                                                             values.items()))

    def _emit(self, row: dict, line: str) -> None:
        if not self.writes:
            return
        for backend in self.backends:
            backend.log(row)
        logger.info(line)

    def _console_line(self, row: dict) -> str:
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.2f}%"
        fields = [
            ("step", f"{row['step']}", "\033[31m"),
            ("loss", f"{row['loss']:.4f}", "\033[32m"),
            *[(name.replace("/", "_"), f"{row[name]:.4f}", "\033[32m") for name in self.console_extras if name in row],
            ("grad_norm", f"{row['grad_norm']:.4f}", "\033[33m"),
            ("lr", f"{row['lr']:.3e}", "\033[34m"),
            ("memory", f"{row['memory_gib']:.2f} GiB", "\033[36m"),
            ("tps", f"{row['tps']:,.0f}", "\033[35m"),
            ("tflops", f"{row['tflops']:.2f}", "\033[36m"),
            ("mfu", mfu, "\033[32m"),
            ("step_time", f"{row['step_time_s']:.3f}s", "\033[37m"),
            ("data", f"{row['data_time_s']:.3f}s ({row['data_pct']:.1f}%)", "\033[37m"),
        ]
        if "moe/max_over_mean" in row:
            # The busiest expert's load over the mean, averaged over the MoE layers (1.0 is perfect balance).
            fields.append(("moe_load", f"{row['moe/max_over_mean']:.2f}", "\033[33m"))
        if "moe/aux_loss" in row:
            fields.append(("moe_aux", f"{row['moe/aux_loss']:.4g}", "\033[33m"))
        if "phase/total/median" in row:  # every rank's steps since the last log row (components/observability)
            fields.append(("ranks_step", f"{row['phase/total/min']:.3f}/{row['phase/total/median']:.3f}/"
                                         f"{row['phase/total/max']:.3f}s", "\033[37m"))
        kind = next((k for k in ("peak_reserved_gib", "peak_rss_gib") if f"memory/{k}/max" in row), None)
        if kind is not None:
            plan = f", plan {row['memory/plan_gib']:.2f}" if "memory/plan_gib" in row else ""
            fields.append(("ranks_memory", f"{row[f'memory/{kind}/min']:.2f}-{row[f'memory/{kind}/max']:.2f} GiB"
                                           f"{plan}", "\033[36m"))
        overlong = [(row.get(f"data/conversations_{kind}", 0), kind) for kind in ("truncated", "dropped")]
        if any(count for count, _ in overlong):
            fields.append(("overlong", ", ".join(f"{count} {kind}" for count, kind in overlong), "\033[33m"))
        reset = "\033[0m"
        return "  ".join(f"{c}{k}: {v}{reset}" if self.color else f"{k}: {v}" for k, v, c in fields)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        if self.progress is not None:
            self.progress.close()


class _ProgressBar:
    """A tqdm bar with ETA on a terminal; log lines are routed around it so neither garbles the other."""

    def __init__(self, total_steps: int):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self.redirect = logging_redirect_tqdm(loggers=[logger])
        self.redirect.__enter__()

    def update(self, step: int) -> None:
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        self.redirect.__exit__(None, None, None)
