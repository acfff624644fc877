"""Tensor parallelism for Kimi Linear's blocks; everything else parallelizes as the shared decoder.

MLA blocks split as DeepSeek-V3's (models/deepseek_v3/parallelize.py). A Kimi Delta Attention block splits its
heads as Gated DeltaNet's (models/qwen3_next/parallelize.py: in_proj_qkv's rows and the conv's channels grouped per
head, the per-head decay parameters split with them, the recurrence rank-local, wo row-parallel). What is its own:
the low-rank decay and output gate. f_a_proj and g_a_proj (dim -> head size) are computed whole on every rank; their
outputs feed f_b_proj and g_b_proj, column-parallel over the heads, whose input gradients ColwiseParallel sums over
the ranks, so the whole projections' gradients are whole on every rank.
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from torchtitan.models.deepseek_v3.parallelize import deepseek_v3_block_plan
from torchtitan.models.kimi_linear.model import KimiDeltaAttention
from torchtitan.models.shared.tensor_parallel_plan import PER_HEAD_NORM
from torchtitan.protocols.tensor_parallel_plan import ComputeWhole, SplitByHeads


def kimi_linear_block_plan(block: nn.Module) -> dict[str, ParallelStyle | ComputeWhole | SplitByHeads]:
    if not isinstance(block.attention, KimiDeltaAttention):
        return deepseek_v3_block_plan(block)
    return {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        **{f"attention.{name}": ColwiseParallel() for name in ("in_proj_qkv", "in_proj_b", "f_b_proj", "g_b_proj")},
        "attention.f_a_proj": ComputeWhole(),
        "attention.g_a_proj": ComputeWhole(),
        "attention.conv": SplitByHeads(),
        "attention.decay": SplitByHeads(),
        "attention.norm": PER_HEAD_NORM,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
