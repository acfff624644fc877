"""Apply parallelism to a Llama 3 model: TP, then AC, then compile, then FSDP/DDP."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.apply_common import apply_ac_compile_and_data_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import enable_async_tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism on the norms.

    Between blocks activations are sharded on the sequence dimension; each block gathers them for
    the column-parallel projections (q/k/v, w1/w3) and its row-parallel projections (wo, w2)
    reduce-scatter back to sequence shards. With loss parallel the logits stay sharded on the vocab.
    """
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    parallelism = job_config.parallelism
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.submesh("tp")
        apply_tp(model, tp_mesh, loss_parallel=not parallelism.disable_loss_parallel)
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)

    return apply_ac_compile_and_data_parallel(model, parallel_dims, job_config)
