"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): keep every attention head's largest logit at or below a threshold
tau by rescaling its query and key weights after each optimizer step (optimizer.qk_clip_threshold).

During each training forward every softmax attention notes, per head, the largest pre-softmax logit
scale * q.k among the pairs its mask lets attend (causal, within a document and a sliding window;
models/shared/attention.py: note_max_logits, about one more q.k^T per layer). After the step the maxima S_h are
reduced (max) over every rank, so data-, context- and pipeline-parallel ranks agree, and each head with
S_h > tau gets gamma_h = tau / S_h:

- multi-head attention: its query rows (weight and bias) and key rows each x sqrt(gamma_h);
- grouped-query attention, where key head g serves the query heads G(g): the key head takes
  gamma_kv = max over G(g) of gamma (1 as soon as one head of the group is not clipped) as sqrt(gamma_kv), and
  each query head h of the group gamma_h / sqrt(gamma_kv). Every logit of head h is then scaled by exactly
  gamma_h and every other head's by 1: a head under tau is never touched, and when the whole group is over tau
  the key shares the reduction (with one query head per key head this is the published sqrt/sqrt split);
- multi-head latent attention: per head, the no-position query rows (wq or wq_b) and key rows (wkv_b's key
  part) x sqrt(gamma_h), the rotary query rows x gamma_h; the rotary key, shared by all heads, is untouched.

Under tensor parallelism each rank holds whole heads (their query and key rows and all of their logits), so the
maxima it noted are its heads' complete maxima and the rows it scales are exactly those heads' rows. Under context
parallelism each rank holds a head and a tail chunk of the sequence: its attention modules' max_logit_fn
(distributed/context_parallel.py: context_parallel_max_logits) gathers the keys of the whole sequence and measures
its own query rows at their global positions, so each pair is measured on the rank that holds its query. The maxima
travel in one max all-reduce over the world, which also carries every other rank's layers, heads and queries, and
with fault-tolerant replica groups synchronising every step, one more over the groups (the same rank of each group),
before they commit the step as they do the gradients, so every group clips alike; DiLoCo's groups, which step apart
between synchronisations, clip on their own maxima.
Parameters sharded by FSDP or TP are scaled on the rows each rank holds. Families that normalise q and k per head
(QK-norm) are refused: the norm undoes any scaling of the projections.

There is no state between steps (the maxima are the step's, then cleared), so checkpoints hold nothing of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.whole_matrices import piece_indices
from torchtitan.models.deepseek_v3.model import MultiHeadLatentAttention
from torchtitan.models.shared.decoder import Attention


def config_problems(optimizer: OptimizerConfig, model_name: str, model_args) -> list[tuple[str, str]]:
    """Problems with optimizer.qk_clip_threshold for this model, as (field, reason) pairs."""
    tau = optimizer.qk_clip_threshold
    field = "optimizer.qk_clip_threshold"
    if not (math.isfinite(tau) and tau >= 0):
        return [(field, f"= {tau} is invalid; it must be > 0 (the largest attention logit allowed) or 0 (off)")]
    if tau == 0:
        return []
    problems = []
    if model_args.qk_norm:
        problems.append((field, f"cannot clip model.name = {model_name!r}: it normalises q and k per head (its "
                                "args' qk_norm), which undoes any scaling of their projections; set it to 0"))
    return problems


def _scale_rows(param: torch.Tensor, factors: torch.Tensor) -> None:
    """Multiply row i of ``param`` (a vector's entry i) by factors[i], on the rows this rank holds."""
    local = param
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate()
        if coordinate is None:
            return
        rows = piece_indices(param.shape, tuple(param.device_mesh.shape), param.placements, coordinate)[0]
        local, factors = param.to_local(), factors[rows.to(factors.device)]
    local.mul_(factors.to(local.dtype).view(-1, *[1] * (local.dim() - 1)))


def _scale_linear(linear: nn.Linear, factors: torch.Tensor) -> None:
    _scale_rows(linear.weight, factors)
    if linear.bias is not None:
        _scale_rows(linear.bias, factors)


def _gqa_factors(gamma: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query head factors, key head factors) for per-query-head gamma (see the module doc)."""
    gamma_kv = gamma.view(kv_heads, -1).amax(dim=1)
    return gamma / gamma_kv.sqrt().repeat_interleave(gamma.numel() // kv_heads), gamma_kv.sqrt()


def clip_attention(module: nn.Module, gamma: torch.Tensor) -> None:
    """Scale ``module``'s query and key weights so that head h's logits are gamma[h] times what they were
    (gamma: every head of the layer, in order; 1 leaves a head alone)."""
    with torch.no_grad():
        if isinstance(module, MultiHeadLatentAttention):
            root = gamma.sqrt()[:, None]
            q = torch.cat([root.expand(-1, module.nope_dim), gamma[:, None].expand(-1, module.rope_dim)], dim=1)
            k = torch.cat([root.expand(-1, module.nope_dim), torch.ones_like(root).expand(-1, module.v_dim)], dim=1)
            _scale_linear(module.wq if module.wq is not None else module.wq_b, q.reshape(-1))
            _scale_linear(module.wkv_b, k.reshape(-1))
        else:
            kv_heads = module.wk.weight.shape[0] // module.head_dim
            q, k = _gqa_factors(gamma, kv_heads)
            _scale_linear(module.wq, q.repeat_interleave(module.head_dim))
            _scale_linear(module.wk, k.repeat_interleave(module.head_dim))


def global_heads(module: nn.Module) -> int:
    if isinstance(module, MultiHeadLatentAttention):
        return module.n_heads
    return module.wq.weight.shape[0] // module.head_dim  # a DTensor's shape is the global one


class QKClip:
    """The clip over a model's attention layers (a no-op with threshold 0). ``tp_rank``/``tp``: this rank's
    place among the tensor-parallel ranks, whose heads are split evenly and in order."""

    def __init__(self, threshold: float, model_parts: list[nn.Module], device: torch.device,
                 tp_rank: int = 0, tp: int = 1):
        self.threshold = threshold
        self.layers: list[tuple[int, nn.Module, int, int]] = []  # (layer id, attention, heads, first local head)
        self.last: dict[str, torch.Tensor] = {}
        self.maxima: torch.Tensor | None = None  # (layers, heads) once reduced, until the step is clipped or discarded
        if threshold == 0:
            return
        for part in model_parts:
            for name, block in part.layers.items():
                for attention in block.modules():
                    if not isinstance(attention, (Attention, MultiHeadLatentAttention)):
                        continue
                    if isinstance(attention, Attention) and attention.q_norm is not None:
                        raise ValueError(f"optimizer.qk_clip_threshold: layer {name}'s attention normalises q and "
                                         "k per head (QK-norm), which undoes the clip; set it to 0")
                    heads = global_heads(attention)
                    local = heads // tp
                    attention.logit_max = torch.full((local,), float("-inf"), device=device)
                    self.layers.append((int(name), attention, heads, tp_rank * local))
        # One (layers x heads) table for the whole model, the same shape on every rank (pipeline stages hold
        # different layers).
        shape = torch.tensor([max((i for i, *_ in self.layers), default=-1) + 1,
                              max((h for _, _, h, _ in self.layers), default=0)], device=device)
        if dist.is_initialized():
            dist.all_reduce(shape, op=dist.ReduceOp.MAX)
        self.shape = tuple(shape.tolist())
        self.device = device

    def reduce(self, across_groups: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Reduce the step's maxima over every rank and, with ``across_groups`` (fault tolerance's elementwise max
        over the replica groups), over the groups: before they commit the step, as for the gradients."""
        if self.threshold == 0:
            return
        maxima = torch.full(self.shape, float("-inf"), device=self.device)
        for layer, attention, _, first in self.layers:
            maxima[layer, first:first + attention.logit_max.numel()] = attention.logit_max
        if dist.is_initialized():
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        self.maxima = maxima if across_groups is None else across_groups(maxima)

    def after_step(self) -> None:
        """Clip the heads whose logits of this step exceeded the threshold, then clear the maxima."""
        if self.threshold == 0:
            return
        if self.maxima is None:
            self.reduce()
        maxima = self.maxima
        over = maxima > self.threshold
        gamma = torch.where(over, self.threshold / maxima, torch.ones_like(maxima))
        for layer, attention, heads, _ in self.layers:
            clip_attention(attention, gamma[layer, :heads])
        self.last = {"qk_clip/heads_clipped": over.sum(), "qk_clip/max_logit": maxima.max()}
        self.discard_step()

    def discard_step(self) -> None:
        """Forget the maxima noted so far (a skipped step's)."""
        self.maxima = None
        for _, attention, _, _ in self.layers:
            attention.logit_max.fill_(float("-inf"))

    def metrics(self) -> dict[str, float]:
        return {name: value.item() for name, value in self.last.items()}
