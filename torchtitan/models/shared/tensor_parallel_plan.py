"""The shared attention's tensor-parallel plan, as data: a family whose blocks hold more (gpt-oss's sinks,
Qwen3-Next's linear-attention layers) extends it instead of restating it.

Each TP rank holds whole heads: the block gathers the sequence-sharded activations, the q/k/v projections are
column-parallel (their rows are grouped per head) and wo row-parallel, reduce-scattering back to sequence shards.
The styles are torch's ParallelStyles and protocols/tensor_parallel_plan.py's entries;
distributed/tensor_parallel.py carries the plan out.
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

# A per-head norm (QK-norm, a gated output norm) acts on each rank's local heads with the full (replicated) head_dim
# weight. Declaring its input as sharded on the heads dimension (2 of batch, seq, heads, head_dim) makes the weight
# a replicated DTensor, so its gradient, a partial sum over each rank's heads, is all-reduced over the TP ranks. A
# plain weight would keep a different partial gradient on every rank (and, being the only non-DTensor parameter,
# make grad-norm clipping fail on the mix).
PER_HEAD_NORM = SequenceParallel(sequence_dim=2, use_local_output=True)


def grouped_query_attention_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """The block's attention (models/shared/decoder.py Attention): whole heads per rank, QK-norm where it has one."""
    plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if getattr(block.attention, "q_norm", None) is not None:
        plan.update({"attention.q_norm": PER_HEAD_NORM, "attention.k_norm": PER_HEAD_NORM})
    return plan
