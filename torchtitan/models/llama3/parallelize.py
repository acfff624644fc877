"""Apply parallelism to a Llama 3 model: TP, then CP, AC, compile and FSDP/DDP."""

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.apply_common import apply_ac_compile_and_data_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_decoder_tp, enable_async_tp


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    parallelism = job_config.parallelism
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.submesh("tp")
        apply_decoder_tp(model, tp_mesh, loss_parallel=not parallelism.disable_loss_parallel)
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)

    return apply_ac_compile_and_data_parallel(model, parallel_dims, job_config)
