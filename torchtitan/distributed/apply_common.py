"""Parallelizing a model, always in the order TP (and EP) -> CP -> AC -> compile -> FSDP/HSDP or DDP.

``parallelize_decoder`` does it all for models built on the shared decoder (models/decoder.py). A
model of another shape applies its own tensor-parallel plan and then calls
``apply_ac_compile_and_data_parallel``, the model-independent rest (MoE layers included).
"""

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.components.document_masking import DocumentMasking
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_context_parallel
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp
from torchtitan.distributed.expert_parallel import apply_moe_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_decoder_tp, enable_async_tp, grouped_query_attention_plan


def parallelize_decoder(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                        block_plan: Callable[[nn.Module], dict[str, ParallelStyle]] = grouped_query_attention_plan,
                        ) -> nn.Module:
    """The TrainSpec.parallelize_fn of every shared-decoder family (``block_plan``: see apply_decoder_tp)."""
    parallelism = job_config.parallelism
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.submesh("tp")
        apply_decoder_tp(model, tp_mesh, loss_parallel=not parallelism.disable_loss_parallel,
                         block_plan=block_plan)
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    return apply_ac_compile_and_data_parallel(model, parallel_dims, job_config)


def apply_ac_compile_and_data_parallel(model: nn.Module, parallel_dims: ParallelDims,
                                       job_config: JobConfig) -> nn.Module:
    ac, training, parallelism = job_config.activation_checkpoint, job_config.training, job_config.parallelism
    has_moe = apply_moe_parallel(model, parallel_dims)
    if parallel_dims.cp_enabled:
        apply_context_parallel(model, parallel_dims.submesh("cp"), training.seq_len,
                               parallelism.context_parallel_rotate_method)
    apply_ac(model, ac.mode, ac.selective_ac_option, ac.preserve_rng_state)
    if job_config.compile.enable and "model" in job_config.compile.components:
        # Context-parallel attention, the MoE's token counting and exchange, and block-causal attention's
        # per-document loop (off CUDA) run eagerly between graphs.
        block_causal = DocumentMasking.from_config(job_config.model, training).block_causal
        apply_compile(model, job_config.compile.backend,
                      fullgraph=not (parallel_dims.cp_enabled or has_moe or block_causal))
    if parallel_dims.fsdp_enabled:
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            expert_mesh=parallel_dims.expert_fsdp_mesh(),
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=training.enable_cpu_offload,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.submesh("dp_replicate"))
    return model
