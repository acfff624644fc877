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
