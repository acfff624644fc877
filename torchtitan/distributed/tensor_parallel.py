"""Tensor-parallel helpers shared by model families."""

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def loss_parallel_context(enabled: bool):
    """Cross-entropy on vocab-sharded logits without gathering them (used around loss and backward)."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def to_local_scalar(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (from loss parallel) as a plain tensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let compiled TP regions overlap their collectives with matmuls (CUDA, symmetric memory)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
