"""The one place that decides the device and the communication backend."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan.config.loading import ConfigError


def device_type() -> str:
    """'cuda' where a GPU is usable, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    """NCCL for GPU tensors (with gloo for CPU ones, e.g. checkpoint metadata); gloo on CPU-only hosts."""
    return "cpu:gloo,cuda:nccl" if device_type() == "cuda" else "gloo"


def launched_distributed() -> bool:
    """True under torchrun/srun-style launchers, which set the rendezvous variables."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if launched_distributed() else 1


def init_distributed(init_timeout_seconds: int) -> torch.device:
    """Join the process group (when launched by torchrun) and return this rank's device.

    A plain ``python -m torchtitan.train`` runs as a world of one and needs no rendezvous.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type() == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count()
        if local_world > gpus:  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") mid-start-up
            raise ConfigError(f"{local_world} processes on this host (LOCAL_WORLD_SIZE) but only {gpus} visible "
                             f"GPU(s): launch at most {gpus} per host (torchrun --nproc_per_node), or train on the CPU "
                             "with CUDA_VISIBLE_DEVICES=''")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launched_distributed() and not dist.is_initialized():
        dist.init_process_group(backend(), timeout=timedelta(seconds=init_timeout_seconds))
    return device


def set_collective_timeout(seconds: int) -> None:
    """Tighten the collective timeout after the first step (start-up may legitimately be slow)."""
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
