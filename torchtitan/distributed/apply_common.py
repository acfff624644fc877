"""Parallelizing a model, always in the order TP (and EP) -> CP -> AC -> compile -> FSDP/HSDP or DDP.

``parallelize_decoder`` does it all for models built on the shared decoder (models/shared/decoder.py), with the
family's tensor-parallel block plan. A model of another shape brings its own TrainSpec.parallelize_fn, which
applies its own tensor-parallel plan and then calls ``apply_ac_compile_and_data_parallel``, the
model-independent rest (MoE layers included). ``parallelize_fn_of`` and ``pipelining_fn_of`` choose.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_context_parallel
from torchtitan.distributed.context_parallel_linear import apply_linear_attention_cp
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp
from torchtitan.distributed.expert_parallel import apply_moe_parallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import build_pipeline
from torchtitan.distributed.tensor_parallel import apply_decoder_tp, enable_async_tp
from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.document_masking import DocumentMasking
from torchtitan.protocols.tensor_parallel_plan import BlockPlan
from torchtitan.protocols.train_spec import TrainSpec


def parallelize_fn_of(spec: TrainSpec) -> Callable[..., nn.Module] | None:
    """The family's parallelize function: its own, or the shared decoder's with its block plan; None for a model
    of another shape that brings none (config_check refuses it)."""
    if spec.parallelize_fn is not None:
        return spec.parallelize_fn
    if issubclass(spec.model_cls, Decoder):
        return partial(parallelize_decoder, block_plan=spec.tp_block_plan)
    return None


def pipelining_fn_of(spec: TrainSpec) -> Callable[..., Any] | None:
    """The family's pipeline split: its own, or the shared decoder's; None: the family cannot be pipelined."""
    if spec.pipelining_fn is not None:
        return spec.pipelining_fn
    return build_pipeline if issubclass(spec.model_cls, Decoder) else None


def parallelize_decoder(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                        block_plan: BlockPlan | None = None) -> nn.Module:
    """Parallelize a model on the shared decoder (``block_plan``: see apply_decoder_tp)."""
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
        apply_linear_attention_cp(model, parallel_dims.submesh("cp"))
    apply_ac(model, ac.mode, ac.selective_ac_option, ac.preserve_rng_state)
    if job_config.compile.enable and "model" in job_config.compile.components:
        # Context-parallel attention, the MoE's token counting and exchange, and block-causal attention's
        # per-document loop (off CUDA), and QK-clip's max-logit measurement run eagerly between graphs.
        block_causal = DocumentMasking.from_config(job_config.model, training).block_causal
        qk_clip = job_config.optimizer.qk_clip_threshold > 0
        apply_compile(model, job_config.compile.backend,
                      fullgraph=not (parallel_dims.cp_enabled or has_moe or block_causal or qk_clip))
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
