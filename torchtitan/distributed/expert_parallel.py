"""Expert parallelism, and how the other parallelisms reach the MoE layer (models/shared/moe.py).

Under expert parallelism (EP) each of the ``ep`` ranks of a group holds ``num_experts / ep`` experts. A MoE
layer routes its own tokens, sorts them by expert, and then:

1. the ranks exchange how many tokens each sends to each expert (one small all-to-all);
2. the tokens travel to the ranks holding their experts (``all_to_all_single`` with per-rank split sizes),
   arriving grouped by source rank, and are regrouped by local expert;
3. the local experts compute (grouped GEMM or loop), and the outputs travel back the same way.

Backward runs the same exchanges in reverse. The sizes are read on the host, so under torch.compile this part
runs between compiled graphs. The experts' weights become DTensors sharded on the expert dimension over the
EP mesh (and on their hidden dimension over the TP mesh); FSDP then shards them over the other dp_shard x cp
ranks (ParallelDims.expert_fsdp_mesh), so checkpoints hold whole (E, dim, hidden) tensors and load under any
EP degree.

Tensor parallelism (TP) does not split the tokens of a MoE layer: every TP rank routes all of them the same
way and computes a slice of every expert's hidden width, so outputs are partial sums over the TP ranks,
reduce-scattered back to sequence shards by the block's TP plan (tensor_parallel.py).
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchtitan.distributed.collectives import sum_grad_over
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.shared.moe import GroupedExperts, MoE, MoEParallelism


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of the rows of x (send ``input_splits[r]`` rows to rank r, receive ``output_splits[r]``
    from it); backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def _source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The row order that regroups rows arriving as (source rank, local expert) blocks, ``counts[s, e]`` rows
    each, into (local expert, source rank) blocks: each expert's rows then lie together."""
    sources, experts = counts.shape
    flat = counts.flatten()
    starts = torch.cumsum(flat, 0) - flat
    # Block (s, e) sits at index s * experts + e; visit them expert-major.
    blocks = (torch.arange(experts, device=counts.device)[:, None] + torch.arange(sources, device=counts.device)
              * experts).flatten()
    sizes = flat[blocks]
    total = int(flat.sum())
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes,
                                                                                output_size=total)
    return torch.repeat_interleave(starts[blocks], sizes, output_size=total) + within


class ExpertAllToAll:
    """MoEParallelism.expert_exchange under expert parallelism over ``group``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, sorted_tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        ep = self.size
        local = counts.numel() // ep
        # received[s, e]: tokens rank s sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, local)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        arrived = _AllToAll.apply(sorted_tokens, recv_splits, send_splits, self.group)
        order = _source_major_to_expert_major(received)
        out = experts(arrived[order], received.sum(dim=0))
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return _AllToAll.apply(out[back], send_splits, recv_splits, self.group)


# Which dimension of each stacked matrix holds the hidden width (split by TP); dimension 0 is the expert.
_HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}
# The experts' biases (gpt-oss): b1, b3 (E, hidden) split like the hidden width; b2 (E, dim) whole on every TP rank.
_BIAS_HIDDEN_DIM = {"b1": 1, "b3": 1, "b2": None}


def _expert_mesh(parallel_dims: ParallelDims) -> tuple[DeviceMesh | None, bool, bool]:
    ep, tp = parallel_dims.submesh("ep"), parallel_dims.submesh("tp")
    if ep is not None and tp is not None:
        return DeviceMesh._concatenate([ep, tp]), True, True
    return (ep or tp), ep is not None, tp is not None


def apply_moe_parallel(model: nn.Module, parallel_dims: ParallelDims) -> bool:
    """Shard every MoE layer's experts over the EP (and TP) mesh and give the layers their communication:
    the token exchange (EP), the TP group (partial expert outputs) and the CP group (the sequence-wise
    auxiliary loss sums its counts over a sequence's shards). Returns whether the model has MoE layers."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return False
    mesh, on_ep, on_tp = _expert_mesh(parallel_dims)
    cp = parallel_dims.submesh("cp")
    for moe in moes:
        if mesh is not None:
            for name, hidden_dim in {**_HIDDEN_DIM, **_BIAS_HIDDEN_DIM}.items():
                param = getattr(moe.experts, name)
                if param is None:
                    continue
                tp_placement = Replicate() if hidden_dim is None else Shard(hidden_dim)
                placements = [*([Shard(0)] if on_ep else []), *([tp_placement] if on_tp else [])]
                setattr(moe.experts, name, nn.Parameter(distribute_tensor(param.data, mesh, placements),
                                                      requires_grad=param.requires_grad))
        moe.parallelize(MoEParallelism(
            expert_exchange=ExpertAllToAll(parallel_dims.submesh("ep").get_group()) if on_ep else None,
            sum_partial_grad=partial(sum_grad_over, group=parallel_dims.submesh("tp").get_group()) if on_tp else None,
            sequence_group=cp.get_group() if cp is not None else None,
            tp_degree=parallel_dims.submesh("tp").size() if on_tp else 1,
        ))
    return True
