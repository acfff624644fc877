"""Exact context parallelism for linear-attention layers (Gated DeltaNet, Kimi Delta Attention), packed documents
included.

Each rank holds the head-tail shard of the sequence that context-parallel attention uses (context_parallel.py):
global chunks r and 2*cp-1-r of 2*cp equal ones. A linear layer's output on a chunk depends on everything before
it only through two things: the conv's last kernel-1 inputs of the previous chunk, and the recurrent state
entering the chunk. The conv's history is one all-gather of every chunk's last inputs. The state is affine: a
chunk maps an incoming state S to M S + N and its outputs are o0 + S^T qt (models/shared/gated_delta_rule.py,
chunk_transition), so every rank computes its two chunks' (M, N, o0, qt) from a zero start, all-gathers the
(M, N) pairs (K x (K + V) per head and chunk, independent of the sequence length), composes them in sequence order
to get the true state entering each of its chunks, and finishes its outputs. Documents crossing a cut are exact:
a chunk in which a document starts has M = 0, so nothing before that document reaches past it, and the conv's
taps compare document ids across the cut.

Backward is autograd through the same computation; the all-gathers' backward sums, over the ranks, the gradients
each rank's chain and conv gave the gathered pieces and hands every rank those of its own. The price is the
transition probe: K extra value channels in the local kernel (about twice its work for K = V).
"""

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import full_document_ids
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.gated_delta_rule import apply_incoming, chunk_transition
from torchtitan.models.shared.gated_deltanet import causal_short_conv, document_resets, recurrence_kernel


class _AllGather(torch.autograd.Function):
    """(cp, *shape) of every rank's tensor; backward: this rank's slice of the gradients summed over the ranks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        out = t.new_empty(cp * t.shape[0], *t.shape[1:])
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out.view(cp, *t.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # summed in place: not autograd's own buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _owner(chunk: int, cp: int) -> tuple[int, int]:
    """(rank, 0 for its head or 1 for its tail) holding global chunk ``chunk`` of the 2*cp."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def _my_chunks(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def cp_conv(x: torch.Tensor, weight: torch.Tensor, documents: DocumentMask | None, *,
            group: dist.ProcessGroup) -> torch.Tensor:
    """The causal short conv of this rank's head-tail shard x (B, 2c, C), reading the previous chunks' last inputs
    from their ranks."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    history = weight.shape[-1] - 1
    c = x.shape[1] // 2
    if c < history:
        raise ValueError(f"context parallel: each of the 2 * {cp} sequence chunks holds {c} tokens, fewer than the "
                         f"conv's history of {history}; use a longer training.seq_len or a smaller "
                         "context_parallel_degree")
    ends = _AllGather.apply(torch.stack([x[:, c - history: c], x[:, 2 * c - history:]]), group)  # (cp, 2, B, h, C)
    full_ids = None if documents is None else full_document_ids(documents, group)
    parts = []
    for part, chunk in enumerate(_my_chunks(rank, cp)):
        span = x[:, part * c: (part + 1) * c]
        ids = None if full_ids is None else full_ids[:, chunk * c: (chunk + 1) * c]
        if chunk == 0:
            parts.append(causal_short_conv(span, weight, ids))
            continue
        before = ends[_owner(chunk - 1, cp)]
        before_ids = None if full_ids is None else full_ids[:, chunk * c - history: chunk * c]
        parts.append(causal_short_conv(span, weight, ids, before, before_ids))
    return torch.cat(parts, dim=1)


def cp_recurrence(q, k, v, g, beta, documents: DocumentMask | None, *, group: dist.ProcessGroup):
    """The gated delta rule on this rank's head-tail shard, with the states entering its chunks composed from
    every chunk's transition (see the module docstring); g per head or per key channel (Kimi Delta Attention).
    Returns (outputs, None)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[1] // 2
    full_resets = None if documents is None else document_resets(full_document_ids(documents, group))
    kernel = recurrence_kernel(q.device)
    spans, maps = [], []
    for part, chunk in enumerate(_my_chunks(rank, cp)):
        local = slice(part * c, (part + 1) * c)
        resets = None if full_resets is None else full_resets[:, chunk * c: (chunk + 1) * c]
        o0, qt, M, N = chunk_transition(q[:, local], k[:, local], v[:, local], g[:, local], beta[:, local], resets,
                                        kernel=kernel)
        spans.append((o0, qt))
        maps.append(torch.cat([M, N], dim=-1))
    gathered = _AllGather.apply(torch.stack(maps), group)  # (cp, 2, B, H, K, K + V)
    dk = k.shape[-1]
    state = torch.zeros_like(maps[0][..., dk:])
    entering = {}
    for chunk in range(max(_my_chunks(rank, cp)) + 1):
        entering[chunk] = state
        M, N = gathered[_owner(chunk, cp)].split([dk, state.shape[-1]], dim=-1)
        state = M @ state + N
    outputs = [apply_incoming(o0, qt, entering[chunk]) for (o0, qt), chunk in zip(spans, _my_chunks(rank, cp))]
    return torch.cat(outputs, dim=1), None


def apply_linear_attention_cp(model: torch.nn.Module, cp_mesh: DeviceMesh) -> int:
    """Give every linear-attention module of ``model`` (one with ``conv_fn`` and ``recurrence_fn``) the versions
    above; returns how many it changed. Collectives inside: compiled blocks call them eagerly."""
    group = cp_mesh.get_group()
    patched = 0
    for module in model.modules():
        if hasattr(module, "recurrence_fn") and hasattr(module, "conv_fn"):
            module.conv_fn = torch.compiler.disable(partial(cp_conv, group=group))
            module.recurrence_fn = torch.compiler.disable(partial(cp_recurrence, group=group))
            patched += 1
    return patched
