"""Tensor parallelism: its config rules and the plan shared by the decoder families."""

import contextlib
import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torch.nn.utils.stateless import _reparametrize_module

from torchtitan.config.job_config import Compile, Parallelism, Training
from torchtitan.distributed.collectives import sum_grad_over
from torchtitan.distributed.device import device_type
from torchtitan.models.shared.lora import is_adapted
from torchtitan.models.shared.tensor_parallel_plan import grouped_query_attention_plan
from torchtitan.protocols.tensor_parallel_plan import BlockPlan, ComputeWhole, SplitByHeads


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
    # experts leave their output partial too; the router stays whole on every rank (it reads its weight as a
    # local tensor; a replicated DTensor keeps every parameter of one kind, and its gradient is whole because
    # the MoE sums the routing weights' gradients over the TP ranks).
    plan: dict[str, ParallelStyle] = {
        "moe.router": ReplicatedWeightsOnly(),
        "moe": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Partial(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True),
    }
    if block.moe.shared_experts is not None:
        plan.update({"moe.shared_experts.w1": ColwiseParallel(), "moe.shared_experts.w3": ColwiseParallel(),
                     "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial())})
    if getattr(block.moe, "shared_gate", None) is not None:
        plan["moe.shared_gate"] = ReplicatedWeightsOnly()  # whole, like the router (see MoE._shared)
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


class ReplicatedParallel(ParallelStyle):
    """A module every TP rank computes whole, on the same whole input (e.g. a low-rank projection too small to
    split). Its parameters become replicated DTensors, so optimizers, grad-norm clipping and FSDP see one kind
    of parameter; its input and output stay plain tensors.

    The gradient reaching its output must then be whole on every rank. Output channels from ``partial_grad_from``
    on are used by each rank for its own heads only, so their gradient is a partial sum: it is summed over the
    TP ranks in backward.
    """

    def __init__(self, partial_grad_from: int | None = None):
        super().__init__()
        self.partial_grad_from = partial_grad_from

    def _input_fn(self, module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor)
                     and not isinstance(t, DTensor) else t for t in inputs)

    def _output_fn(self, module, output, mesh):
        output = output.to_local()
        if self.partial_grad_from is None:
            return output
        whole, partial = output.split([self.partial_grad_from, output.shape[-1] - self.partial_grad_from], dim=-1)
        return torch.cat([whole, sum_grad_over(partial, mesh.get_group())], dim=-1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition function: distribute_module replicates every parameter.
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)


class ReplicatedWeightsOnly(ParallelStyle):
    """Only turn the module's parameters into replicated DTensors, for a module that reads them as local
    tensors and whose gradients are whole on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class ComputedWholeOnEveryRank(ParallelStyle):
    """A module too small to split that every TP rank computes whole on the same input (the vision tower): its
    weights become replicated DTensors (one kind of parameter for the optimizers, grad-norm clipping and FSDP), and
    its forward runs on their local tensors, so it computes as plain code does. The gradient reaching its outputs
    must be whole on every rank (IMAGE_TOKENS_PLAN sees to it for the tower): the weights' gradients then are.

    The swap to local tensors is made for the whole module's forward (which may read a weight directly) and again
    for each submodule's own weights when that submodule runs alone: activation checkpointing recomputes a block
    in the backward, outside the module's forward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)
        _run_on_local_weights(module, recurse=True)
        for submodule in module.modules():
            if any(True for _ in submodule.parameters(recurse=False)):
                _run_on_local_weights(submodule, recurse=False)
        return module


def _run_on_local_weights(module: nn.Module, recurse: bool) -> None:
    """Make ``module``'s forward see the local tensors of its replicated weights (to_local is differentiable: the
    gradient comes back to the replicated weight); weights already swapped by an enclosing module are left. A
    with-block, not a pair of hooks: a forward that stops early (checkpointing's recompute does) still restores."""
    forward = module.forward

    def on_local_weights(*args, **kwargs):
        local = {name: p.to_local() for name, p in module.named_parameters(recurse=recurse) if isinstance(p, DTensor)}
        with _reparametrize_module(module, local):
            return forward(*args, **kwargs)

    module.forward = on_local_weights


# The image features go into the whole sequence on every rank, which then keeps its sequence shard: the gradient
# coming back is gathered whole (the backward of that split), so every rank's features, and the tower that made
# them (computed whole on every rank: its weights are replicated), get the whole gradient. DeepStack adds features
# after a block, whose output is sequence shards: gathered first.
IMAGE_TOKENS_PLAN = {
    "image_scatter": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    "deepstack_scatter": PrepareModuleInputOutput(
        input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None),
        use_local_input=True, output_layouts=Replicate(), desired_output_layouts=Shard(1)),
}


def apply_decoder_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool,
                     block_plan: BlockPlan | None = None) -> None:
    """Megatron-style TP with sequence parallelism on the norms, for a decoder named like Llama's
    (tok_embeddings, layers.N.{attention_norm, attention, ffn_norm, feed_forward.w1/w2/w3 or moe}, norm, output);
    ``block_plan(block)`` splits a block's attention and anything else a family puts in its blocks (None:
    grouped-query attention's plan); entries are torch ParallelStyles or protocols' ComputeWhole.

    Between blocks activations are sharded on the sequence dimension; each block gathers them for
    the column-parallel projections (q/k/v, w1/w3), whose outputs hold whole heads, and its
    row-parallel projections (wo, w2) reduce-scatter back to sequence shards. With loss parallel
    the logits stay sharded on the vocabulary.
    """
    block_plan = block_plan or grouped_query_attention_plan
    computes_loss = getattr(model.output, "computes_loss", False)
    # torch's SequenceParallel makes the parameters it distributes trainable whatever they were; a frozen weight
    # (a LoRA base's norm) is frozen again below.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    # A model that reads images (models/shared/vision_language.py) places them in the whole sequence: its
    # embeddings stay whole until then.
    images = getattr(model, "image_scatter", None) is not None
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate() if images else Shard(1)),
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
            **block_plan(block),
            "ffn_norm": SequenceParallel(),
            **_feed_forward_plan(block),
        }
        plan = {name: _style(entry, block.get_submodule(name)) for name, entry in plan.items()}
        parallelize_module(block, tp_mesh, plan)
    if images:
        tower = {"visual": ComputedWholeOnEveryRank()} if model.visual is not None else {}  # on the first stage
        parallelize_module(model, tp_mesh, {**IMAGE_TOKENS_PLAN, **tower})
    if hasattr(model, "tie_weights"):
        # Embedding and output are both sharded on the vocabulary (dim 0), so a tied pair can share
        # one DTensor again after the plan gave each module its own.
        model.tie_weights()
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


class ShardedParameters(ParallelStyle):
    """Only split the module's parameters along dim 0 (see protocols' SplitByHeads); its inputs and outputs are
    the rank's own heads already."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, submodule, mesh):
            for pname, param in list(submodule.named_parameters(recurse=False)):
                submodule.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                                 requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, partition_fn=partition)


def _style(entry: ParallelStyle | ComputeWhole | SplitByHeads, module: nn.Module) -> ParallelStyle:
    if isinstance(entry, ComputeWhole):
        return ReplicatedParallel(entry.partial_grad_from)  # replicates every parameter, adapters included
    if isinstance(entry, SplitByHeads):
        return ShardedParameters()
    if is_adapted(module) and isinstance(entry, (ColwiseParallel, RowwiseParallel)):
        # Same input and output layouts; only how the parameters are split differs.
        adapted = copy.copy(entry)
        adapted.__class__ = _AdaptedColwise if isinstance(entry, ColwiseParallel) else _AdaptedRowwise
        return adapted
    return entry


def _split_adapted(name: str, module: nn.Module, mesh: DeviceMesh,
                   placements: dict[str, tuple[Placement, Placement]]) -> None:
    """Partition an adapted Linear (models/shared/lora.py): distribute_module calls this for the Linear ("") and each
    child; ``placements`` gives each one's (weight, bias) placement."""
    for pname, param in list(module.named_parameters(recurse=False)):
        placement = placements[name][0 if pname == "weight" else 1]
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                      requires_grad=param.requires_grad))


class _AdaptedColwise(ColwiseParallel):
    """A column-parallel base splits its output features, and so does B (out x r); A (r x in) reads the whole
    input, so every rank holds all of it: the adapter's output is split like the base's, and A's gradient,
    a sum over output features, arrives as a partial sum that DTensor adds up over the TP ranks."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _split_adapted(name, module, device_mesh, {"": (Shard(0), Shard(0)), "lora_a": (Replicate(), Replicate()),
                                                   "lora_b": (Shard(0), Shard(0))})


class _AdaptedRowwise(RowwiseParallel):
    """A row-parallel base splits its input features, and so does A (r x in), so A x is a partial sum like the
    base's output; B (out x r) is whole on every rank, and the two partial outputs are reduced together."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _split_adapted(name, module, device_mesh, {"": (Shard(1), Replicate()), "lora_a": (Shard(1), Replicate()),
                                                   "lora_b": (Replicate(), Replicate())})


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
