"""Learning-rate schedule: linear warmup, an optional stable phase, then decay (warmup-stable-decay)."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig


def lr_factor(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak lr used for (1-based) training ``step``."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        return step / warmup
    after_warmup = total_steps - warmup
    decay_steps = after_warmup if cfg.decay_ratio is None else round(cfg.decay_ratio * after_warmup)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    remaining = {
        "linear": 1.0 - progress,
        "sqrt": 1.0 - math.sqrt(progress),
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[cfg.decay_type]
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> LambdaLR:
    # LambdaLR counts completed steps from 0, so the lr for step s is lr_factor(s) with s = count + 1.
    return LambdaLR(optimizer, lambda completed: lr_factor(completed + 1, cfg, total_steps))
