"""Gradient-norm clipping that works for plain tensors and sharded (DTensor) gradients alike."""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.collectives import sum_over


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Clip to ``max_norm`` (skipped when <= 0) and return the global L2 norm before clipping.

    With pipeline parallelism each rank holds only its stages' parameters: ``pp_mesh`` adds the
    squared norms of the other stages.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        # Each rank holds a partial norm of its shards; reduce to the norm of the whole model.
        total = total.full_tensor()
    if pp_mesh is not None:
        total = sum_over(total**2, pp_mesh) ** 0.5
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total
