"""Tensor parallelism for gpt-oss's attention: grouped-query attention's plan (whole heads per rank; the
projections' biases split with their rows, wo's added once after the reduction, as torch's styles do) and each
rank keeping its own heads' sink logits (their gradients are whole on that rank)."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from torchtitan.protocols.tensor_parallel_plan import SplitByHeads


def gpt_oss_block_plan(block: nn.Module) -> dict[str, ParallelStyle | SplitByHeads]:
    return {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "attention.sinks": SplitByHeads(),
    }
