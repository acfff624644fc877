"""Output projection and cross-entropy computed together over chunks of tokens (training.loss_chunk_size).

With a large vocabulary the float32 logits ``[tokens, vocab]`` are the largest activation of a step (8,192 tokens
x 128,256 entries is 4 GiB, plus as much again for their gradient). Here each chunk of ``chunk_size`` tokens is
projected, reduced to its log-sum-exp and target logit, and dropped; backward recomputes the chunk's logits to
form ``softmax - onehot``. Only one chunk's logits exist at a time, and the forward keeps one float per token.
The cost is the projection computed twice (forward and backward), as activation checkpointing would.

The numbers are those of the plain path: the matmul runs in the same dtype (autocast's, or the inputs' under
FSDP mixed precision) and the softmax in float32; tokens labelled IGNORE_INDEX contribute nothing.

Under tensor parallelism the weight is sharded on the vocabulary (as for loss parallel): each rank projects onto
its rows, and the per-token maximum, sum of exponentials and target logit are all-reduced over the TP group;
the input's gradient leaves as a partial sum that the sequence-parallel layout reduce-scatters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.models.shared.moe import compute_dtype_of


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``h @ weight.T`` against ``labels``, chunk by chunk (see the module doc)."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_size, dtype, group, vocab_start):
        valid = labels != IGNORE_INDEX
        local = labels - vocab_start
        mine = valid & (local >= 0) & (local < weight.shape[0])
        local = torch.where(mine, local, 0)
        # Chunks are gathered with torch.cat, not written into slices of a preallocated tensor: inductor on
        # CUDA (torch 2.11) compiled the slice writes of this function into all-zero gradients.
        lses, total = [], torch.zeros((), dtype=torch.float32, device=h.device)
        w = weight.to(dtype)
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (h[rows].to(dtype) @ w.T).float()
            peak = logits.max(dim=1).values
            if group is not None:
                dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
            sums = torch.exp(logits - peak[:, None]).sum(dim=1)
            target = torch.where(mine[rows], logits.gather(1, local[rows, None]).squeeze(1), 0.0)
            if group is not None:
                dist.all_reduce(sums, group=group)
                dist.all_reduce(target, group=group)
            lses.append(peak + sums.log())
            total = total + torch.where(valid[rows], lses[-1] - target, 0.0).sum()
        ctx.save_for_backward(h, weight, torch.cat(lses), valid, mine, local)
        ctx.chunk_size, ctx.dtype, ctx.group = chunk_size, dtype, group
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, weight, lse, valid, mine, local = ctx.saved_tensors
        dtype = ctx.dtype
        w = weight.to(dtype)
        grad_hs, grad_w = [], torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad_total.float()
        for start in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            hc = h[rows].to(dtype)
            probs = torch.exp((hc @ w.T).float() - lse[rows, None])
            # softmax - onehot, where this rank holds the target (a static-shape scatter: compiles cleanly)
            probs = probs.scatter_add(1, local[rows, None], -mine[rows, None].float())
            dlogits = (probs * torch.where(valid[rows], scale, 0.0)[:, None]).to(dtype)
            grad_hs.append((dlogits @ w).to(h.dtype))
            grad_w = grad_w + (dlogits.T @ hc).float()
        return torch.cat(grad_hs), grad_w.to(weight.dtype), None, None, None, None, None


class ChunkedLinearCrossEntropy(nn.Linear):
    """The output projection (an ``nn.Linear``, so names, initialisation and checkpoints are unchanged) that,
    given ``labels``, returns the summed cross-entropy instead of logits, computed chunk by chunk."""

    computes_loss = True

    def __init__(self, in_features: int, out_features: int, chunk_size: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.chunk_size = chunk_size
        self.loss_sum = _ChunkedCrossEntropy.apply

    def compile_loss(self, backend: str) -> None:
        """Compile the chunk loop (compile.components "loss"); without tensor parallelism only."""
        self.loss_sum = torch.compile(_ChunkedCrossEntropy.apply, backend=backend)

    @classmethod
    def replacing(cls, linear: nn.Linear, chunk_size: int) -> ChunkedLinearCrossEntropy:
        """A chunked head with ``linear``'s shape and weight (the model's output projection, on any device)."""
        if type(linear) is not nn.Linear or linear.bias is not None:
            raise ValueError(f"training.loss_chunk_size replaces the output projection, a bias-free nn.Linear; this "
                             f"model's is a {type(linear).__name__}")
        head = cls(linear.in_features, linear.out_features, chunk_size, device=linear.weight.device,
                   dtype=linear.weight.dtype)
        head.weight = linear.weight
        return head

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        weight, group, vocab_start = self.weight, None, 0
        if isinstance(weight, DTensor):  # tensor parallel: vocab rows sharded over the TP mesh
            mesh = weight.device_mesh
            group = mesh.get_group()
            vocab_start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
            weight = weight.to_local()
            # The input's gradient is this rank's share of a sum over the vocabulary shards.
            h = h.to_local(grad_placements=[Partial()]) if isinstance(h, DTensor) else h
        total = self.loss_sum(h.flatten(0, -2), weight, labels.flatten(), self.chunk_size, compute_dtype_of(h), group,
                              vocab_start)
        if group is not None:  # the same value on every rank; ColwiseParallel's output hook unwraps it
            return DTensor.from_local(total, self.weight.device_mesh, [Replicate()], run_check=False)
        return total

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"


def use_chunked_loss(model: nn.Module, chunk_size: int) -> None:
    """Replace ``model.output`` (before parallelizing) with a ChunkedLinearCrossEntropy of the same weight."""
    if not isinstance(getattr(model, "output", None), nn.Linear):
        raise ValueError(f"training.loss_chunk_size = {chunk_size} needs a model whose output projection is "
                         f"model.output, an nn.Linear; {type(model).__name__} has none")
    model.output = ChunkedLinearCrossEntropy.replacing(model.output, chunk_size)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
