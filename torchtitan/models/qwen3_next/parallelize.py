"""Tensor parallelism for Qwen3-Next's blocks; everything else parallelizes as the shared decoder.

Each TP rank holds whole heads. Gated attention splits like grouped-query attention: wq's rows are grouped per
head (query, then gate), so a column split hands every rank its heads' gates too. A Gated DeltaNet layer splits
its key heads, each with the value heads it serves: the input projections are column-parallel (in_proj_qkv's rows
and the conv's channels are grouped per key head, so a rank's share is one contiguous slice of each), the conv
and the per-head decay parameters are split the same way and computed locally (their gradients are whole on the
rank that owns them), the output norm's weight is shared by all heads (replicated, its per-rank partial gradients
summed, as for QK-norm) and wo is row-parallel. The input gradients of the column-parallel projections are partial
sums, which ColwiseParallel adds up; so the rank-local recurrence needs no communication at all.
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from torchtitan.models.shared.gated_deltanet import GatedDeltaNet
from torchtitan.models.shared.tensor_parallel_plan import PER_HEAD_NORM, grouped_query_attention_plan
from torchtitan.protocols.tensor_parallel_plan import SplitByHeads


def qwen3_next_block_plan(block: nn.Module) -> dict[str, ParallelStyle | SplitByHeads]:
    if not isinstance(block.attention, GatedDeltaNet):
        return grouped_query_attention_plan(block)  # gated attention: wq's rows hold each head's query and gate
    return {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        **{f"attention.{name}": ColwiseParallel() for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
        "attention.conv": SplitByHeads(),
        "attention.decay": SplitByHeads(),
        "attention.norm": PER_HEAD_NORM,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
