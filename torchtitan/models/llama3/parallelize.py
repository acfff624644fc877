"""Apply parallelism to a Llama 3 model: TP, then AC, then compile, then FSDP/DDP."""

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option, ac.preserve_rng_state)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model, job_config.compile.backend)
    training = job_config.training
    if parallel_dims.fsdp_enabled:
        # HSDP when there are replicas too: a 2-D (replicate, shard) mesh.
        hsdp = parallel_dims.dp_replicate_enabled
        apply_fsdp(
            model,
            parallel_dims.submesh(("dp_replicate", "dp_shard_cp") if hsdp else "dp_shard_cp"),
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=training.enable_cpu_offload,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.submesh("dp_replicate"))
    return model
