"""Tensor parallelism: its config rules and the plan shared by the decoder families."""

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import Compile, Parallelism, Training
from torchtitan.distributed.device import device_type


# QK-norm acts on each rank's local heads with the full (replicated) head_dim weight. Declaring its input
# as sharded on the heads dimension (2 of batch, seq, heads, head_dim) makes the weight a replicated
# DTensor, so its gradient, a partial sum over each rank's heads, is all-reduced over the TP ranks. A plain
# weight would keep a different partial gradient on every rank (and, being the only non-DTensor
# parameter, make grad-norm clipping fail on the mix).
_QK_NORM_PLAN = {name: SequenceParallel(sequence_dim=2, use_local_output=True)
                 for name in ("attention.q_norm", "attention.k_norm")}


def _feed_forward_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    if not getattr(block, "moe_enabled", False):
        return {
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
    # A MoE takes the full sequence and returns partial sums over the TP ranks (each computes a slice of every
    # expert's hidden width; distributed/expert_parallel.py), reduce-scattered to sequence shards. Its shared
    # experts leave their output partial too; the router stays whole on every rank.
    plan: dict[str, ParallelStyle] = {
        "moe": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Partial(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True),
    }
    if block.moe.shared_experts is not None:
        plan.update({"moe.shared_experts.w1": ColwiseParallel(), "moe.shared_experts.w3": ColwiseParallel(),
                     "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial())})
    return plan


def config_problems(p: Parallelism, t: Training, compile_cfg: Compile) -> list[tuple[str, str]]:
    """The first problem (full config key, reason) with tensor parallelism as configured, or []."""
    tp, key = p.tensor_parallel_degree, "parallelism.tensor_parallel_degree"
    if t.seq_len % tp != 0:
        return [(key, f"does not divide training.seq_len = {t.seq_len}, which sequence parallelism shards")]
    if tp > 1 and compile_cfg.enable and "loss" in compile_cfg.components and t.loss_chunk_size > 0:
        return [("compile.components", "includes 'loss', which is not compiled with training.loss_chunk_size under "
                 "tensor parallelism (its chunk loop all-reduces over the TP group); leave 'loss' out of "
                 "compile.components")]
    if tp > 1 and compile_cfg.enable and "loss" in compile_cfg.components and not p.disable_loss_parallel:
        return [("compile.components", "includes 'loss', which cannot be compiled with loss parallel (the compiled "
                 "cross-entropy ignores the vocab sharding); set parallelism.disable_loss_parallel = true or "
                 "leave 'loss' out of compile.components")]
    if p.enable_async_tensor_parallel:
        # Async TP rewrites compiled graphs to overlap NCCL collectives using symmetric memory.
        key = "parallelism.enable_async_tensor_parallel"
        if tp == 1:
            return [(key, "needs parallelism.tensor_parallel_degree > 1")]
        if device_type() != "cuda":
            return [(key, f"needs CUDA GPUs (symmetric memory); this machine's device is '{device_type()}'")]
        if not compile_cfg.enable:
            return [(key, "needs compile.enable = true (it works on compiled graphs)")]
    return []


def apply_decoder_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool,
                     extra_block_plan: dict[str, ParallelStyle] | None = None) -> None:
    """Megatron-style TP with sequence parallelism on the norms, for a decoder named like Llama's
    (tok_embeddings, layers.N.{attention_norm, attention.wq/wk/wv/wo, ffn_norm, feed_forward.w1/w2/w3 or moe},
    norm, output), with QK-norm where the blocks have it; ``extra_block_plan`` adds a family's own modules.

    Between blocks activations are sharded on the sequence dimension; each block gathers them for
    the column-parallel projections (q/k/v, w1/w3), whose outputs hold whole heads, and its
    row-parallel projections (wo, w2) reduce-scatter back to sequence shards. With loss parallel
    the logits stay sharded on the vocabulary.
    """
    computes_loss = getattr(model.output, "computes_loss", False)
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # A head that computes the loss (ChunkedLinearCrossEntropy) reduces over the vocab shards itself and
            # returns a replicated scalar.
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel and not computes_loss else Replicate(),
                use_local_output=not loss_parallel or computes_loss,
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
            **_feed_forward_plan(block),
            **(_QK_NORM_PLAN if getattr(block.attention, "q_norm", None) is not None else {}),
            **(extra_block_plan or {}),
        }
        parallelize_module(block, tp_mesh, plan)
    if hasattr(model, "tie_weights"):
        # Embedding and output are both sharded on the vocabulary (dim 0), so a tied pair can share
        # one DTensor again after the plan gave each module its own.
        model.tie_weights()


def loss_parallel_context(enabled: bool):
    """Cross-entropy on vocab-sharded logits without gathering them (used around loss and backward)."""
    return torch.distributed.tensor.parallel.loss_parallel() if enabled else contextlib.nullcontext()


def to_local_scalar(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (from loss parallel) as a plain tensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let compiled TP regions overlap their collectives with matmuls (CUDA, symmetric memory)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
