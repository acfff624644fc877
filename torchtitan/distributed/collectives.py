"""Small collective helpers that degrade to no-ops in a single process."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


def sum_over(tensor: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum a tensor over the ranks of ``mesh`` (identity when there is none)."""
    if mesh is None or not dist.is_initialized():
        return tensor
    return funcol.all_reduce(tensor, reduceOp="sum", group=mesh)


def sum_now(tensor: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """A copy of ``tensor`` summed over the ranks of ``mesh``, complete on return (a blocking all-reduce, where
    ``sum_over`` returns a tensor that completes on first use: for results kept across steps)."""
    tensor = tensor.clone()
    if mesh is not None and dist.is_initialized():
        dist.all_reduce(tensor, group=mesh.get_group())
    return tensor
