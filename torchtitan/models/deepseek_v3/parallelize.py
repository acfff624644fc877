"""Tensor parallelism for multi-head latent attention; the rest of DeepSeek-V3 parallelizes as the shared decoder.

Each TP rank holds whole heads: the head projections (wq or wq_b, wkv_b) are column-parallel and wo row-parallel,
as in grouped-query attention. The low-rank projections (wq_a, wkv_a) and their norms are small (rank 512-1536
against hidden 7168) and feed every head, so every rank computes them whole. Their gradients are whole on every
rank because the column-parallel projections sum theirs over the ranks in backward; the one exception is the
rotary key (the last qk_rope_head_dim channels of wkv_a), which each rank uses for its own heads only: its
gradient is summed explicitly (ComputeWhole's partial_grad_from). Multi-token prediction blocks add per-token
modules, split along the sequence like the norms. The plan is data (TrainSpec.tp_block_plan); the shared
parallelize path carries it out.
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.models.deepseek_v3.model import MultiTokenPredictionBlock
from torchtitan.protocols.tensor_parallel_plan import ComputeWhole


def latent_attention_plan(block: nn.Module) -> dict[str, ParallelStyle | ComputeWhole]:
    attention = block.attention
    # Plain (local) whole-sequence input: the replicated projections take it as it is.
    plan: dict[str, ParallelStyle | ComputeWhole] = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                        use_local_output=True),
        "attention.wkv_a": ComputeWhole(partial_grad_from=attention.kv_lora_rank),
        "attention.kv_norm": ComputeWhole(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.wq is not None:
        plan["attention.wq"] = ColwiseParallel()
    else:
        plan.update({"attention.wq_a": ComputeWhole(), "attention.q_norm": ComputeWhole(),
                     "attention.wq_b": ColwiseParallel()})
    return plan


def deepseek_v3_block_plan(block: nn.Module) -> dict[str, ParallelStyle | ComputeWhole]:
    plan = latent_attention_plan(block)
    if isinstance(block, MultiTokenPredictionBlock):
        # Per token, on the sequence shards the blocks pass along: the norms and the projection of the joined
        # embedding and hidden state (replicated weights, gradients summed over the shards by DTensor). The
        # projection hands the block a plain tensor, as the previous block's output is.
        plan.update({"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
                     "eh_proj": SequenceParallel(use_local_output=True), "norm": SequenceParallel()})
    return plan

