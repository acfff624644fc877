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


class _SumGradOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = funcol.all_reduce(grad.contiguous(), reduceOp="sum", group=ctx.group)
        # A plain tensor to autograd (eager gives an AsyncCollectiveTensor; traced code waits already).
        return (summed.wait() if isinstance(summed, funcol.AsyncCollectiveTensor) else summed), None


def sum_grad_over(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` itself, whose gradient is summed over ``group`` in backward: for a value every rank holds whole
    but whose uses on each rank (e.g. its tensor-parallel heads) give only a partial gradient."""
    return _SumGradOver.apply(tensor, group)
