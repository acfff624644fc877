"""Compute precision: the dtype names configs use, what ``auto`` means on this machine, and when the trainer
computes under autocast. One rule for the trainer, evaluation and the planner.
"""

import contextlib
import functools
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.config.job_config import Training as TrainingConfig
from torchtitan.hardware import DTYPES, cpu_model, cpuinfo_field
from torchtitan.log import logger

# x86 features with which PyTorch's CPU matmuls run bfloat16 at least as fast as float32.
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def _bf16_matmul_is_faster(seconds: float = 0.1, n: int = 512) -> bool:
    """Time the fastest of a few bfloat16 and float32 matmuls (under a second even where bf16 is 40x slower;
    below ~512 the first calls' thread start-up dominates and misleads)."""
    fastest = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        fastest[dtype], start = float("inf"), time.perf_counter()
        while fastest[dtype] == float("inf") or time.perf_counter() - start < seconds:
            begin = time.perf_counter()
            a @ b
            fastest[dtype] = min(fastest[dtype], time.perf_counter() - begin)
    return fastest[torch.bfloat16] <= fastest[torch.float32]


@functools.cache
def cpu_computes_bf16_fast() -> bool:
    """Whether bfloat16 matmuls are fast on this CPU: AMX or AVX-512 BF16 where /proc/cpuinfo lists x86
    flags, else (other CPUs, other systems, oneDNN limited by ONEDNN_MAX_CPU_ISA) a short timing of
    bfloat16 against float32."""
    flags = cpuinfo_field("flags")
    # ONEDNN_MAX_CPU_ISA can keep the kernels off the features the flags list: then only a timing tells.
    if flags is not None and not os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return any(flag in flags.split() for flag in FAST_BF16_CPU_FLAGS)
    fast = _bf16_matmul_is_faster()
    if dist.is_initialized():
        # Timings can differ between ranks; every rank must compute in the same dtype.
        agreed = torch.tensor(int(fast))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        fast = bool(agreed)
    return fast


def resolve_compute_dtype(requested: str, device_type: str) -> tuple[str, str]:
    """(dtype name, why) for ``training.mixed_precision_param = requested`` on ``device_type``."""
    if requested != "auto":
        return requested, "as configured"
    if device_type != "cpu":
        return "bfloat16", f"auto: {device_type} devices compute bfloat16 natively"
    if cpu_computes_bf16_fast():
        return "bfloat16", f"auto: this CPU ({cpu_model()}) computes bfloat16 fast"
    return "float32", (f"auto: this CPU ({cpu_model()}) has no fast bfloat16 matmul (no AMX or AVX-512 BF16), "
                       f"where bfloat16 would be several times slower than float32")


def set_compute_dtype(training: TrainingConfig, device_type: str) -> str:
    """Replace ``auto`` in ``training.mixed_precision_param`` by the dtype it means here; log the choice once.

    Everything after (FSDP's policy, autocast, MFU's peak) reads the concrete dtype from the config.
    Returns the reason, for the run's provenance.
    """
    dtype, why = resolve_compute_dtype(training.mixed_precision_param, device_type)
    training.mixed_precision_param = dtype
    logger.info(f"compute dtype {dtype} ({why})")
    return why


def compute_dtype(training: TrainingConfig) -> torch.dtype:
    if training.mixed_precision_param not in DTYPES:
        raise ValueError(f"training.mixed_precision_param = {training.mixed_precision_param!r} is not resolved; "
                         f"call set_compute_dtype first")
    return DTYPES[training.mixed_precision_param]


def uses_autocast(training: TrainingConfig, fsdp_enabled: bool = False) -> bool:
    """The trainer's precision rule, shared by training, evaluation and the planner.

    FSDP's mixed-precision policy casts the parameters to the compute dtype itself, so autocast is
    only needed without FSDP, and only when the compute dtype (training.mixed_precision_param)
    differs from the dtype the parameters are stored in (training.dtype).
    """
    return not fsdp_enabled and compute_dtype(training) != DTYPES[training.dtype]


def compute_autocast(
    training: TrainingConfig, device: torch.device, fsdp_enabled: bool = False
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the trainer computes in: autocast to the compute dtype when
    ``uses_autocast`` says so, else a no-op context."""
    if not uses_autocast(training, fsdp_enabled):
        return contextlib.nullcontext
    dtype = compute_dtype(training)
    return lambda: torch.autocast(device.type, dtype=dtype)
