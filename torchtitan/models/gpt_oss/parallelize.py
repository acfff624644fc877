"""Tensor parallelism for gpt-oss's attention: grouped-query attention's plan (whole heads per rank; the
projections' biases split with their rows, wo's added once after the reduction, as torch's styles do) and each
rank keeping its own heads' sink logits (their gradients are whole on that rank)."""

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.shared.tensor_parallel_plan import grouped_query_attention_plan
from torchtitan.protocols.tensor_parallel_plan import SplitByHeads


def gpt_oss_block_plan(block: nn.Module) -> dict[str, ParallelStyle | SplitByHeads]:
    return grouped_query_attention_plan(block) | {"attention.sinks": SplitByHeads()}
