"""Facts about the machine and the dtype names configs use, which every layer may need."""

import os
import platform
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a config names (training.dtype, mixed_precision_param, ...), by name."""


def cpuinfo_field(name: str) -> str | None:
    """The first ``name`` line of Linux's /proc/cpuinfo (e.g. "model name", "flags"); None elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's marketing name, as the OS reports it."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
