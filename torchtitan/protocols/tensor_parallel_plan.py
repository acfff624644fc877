"""What a family's tensor-parallel plan may say beyond torch's ParallelStyles.

A family on the shared decoder gives ``TrainSpec.tp_block_plan(block)``: its blocks' modules by name, each
with a torch ParallelStyle (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput) or one of
the entries below, which distributed/tensor_parallel.py carries out. The family states what is split; how is
parallelism's business, so a model folder never imports it.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class ComputeWhole:
    """A module every TP rank computes whole on the same whole input (e.g. a low-rank projection too small to
    split); its weights become replicated DTensors, its input and output stay plain tensors. Output channels
    from ``partial_grad_from`` on are used by each rank for its own heads only, so their gradient is summed
    over the TP ranks."""

    partial_grad_from: int | None = None


@dataclass(frozen=True)
class SplitByHeads:
    """A module whose parameters hold per-head values along dim 0 (a depthwise conv over head channels, per-head
    decay rates) and that the layer calls on this rank's heads only: each rank keeps its heads' slice, and the
    gradient of that slice is whole on its rank (no communication)."""


BlockPlan = Callable[[nn.Module], dict[str, ParallelStyle | ComputeWhole | SplitByHeads]]
"""A block's TP plan: {module name within the block: its style}."""
