"""FSDP2 / HSDP and DDP for models built of a stack of blocks under ``model.layers``."""

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchtitan.hardware import DTYPES
from torchtitan.log import logger
from torchtitan.models.shared.moe import GroupedExperts
from torchtitan.models.shared.nf4 import nf4_shardable, nf4_weights, place_nf4_constants
from torchtitan.models.shared.seeded_init import canonical_name


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard the embeddings, each block, and norm+output together, then the root.

    ``mesh`` is 1-D for FSDP or 2-D (replicate, shard) for HSDP. Under expert parallelism ``expert_mesh`` is
    what the experts (already sharded over the EP ranks) are sharded over: each MoE's experts are a unit of
    their own on it, the rest of their block is sharded over ``mesh``.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if whole := _prepare_nf4_weights(model, mesh):
        kwargs["ignored_params"] = whole
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # With PP each micro-batch re-runs forward, so resharding would re-gather the weights every time.
    reshard = {"always": True, "never": False, "default": not pp_enabled}[reshard_after_forward]

    embeddings, norm, output = (getattr(model, name, None) for name in ("tok_embeddings", "norm", "output"))
    # A weight shared by the embeddings and the output must live in one FSDP unit.
    tied = embeddings is not None and output is not None and output.weight is embeddings.weight
    if embeddings is not None and not tied:
        fully_shard(embeddings, reshard_after_forward=reshard, **kwargs)
    for block in model.layers.values():
        if expert_mesh is not None:
            for experts in (m for m in block.modules() if isinstance(m, GroupedExperts)):
                fully_shard(experts, reshard_after_forward=reshard, **{**kwargs, "mesh": expert_mesh},
                            shard_placement_fn=_expert_shard_placement(experts, expert_mesh))
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    tower = getattr(model, "visual", None)  # a vision tower (first pipeline stage): its blocks, then the rest of it
    if tower is not None:
        for block in tower.blocks.values():
            fully_shard(block, reshard_after_forward=reshard, **kwargs)
        fully_shard(tower, reshard_after_forward=reshard, **kwargs)
    final = [m for m in ((embeddings if tied else None), norm, output) if m is not None]
    if final:
        # The last unit is needed again right away in backward, so keep it gathered.
        fully_shard(final, reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    _sum_gradients_on_every_unit(model)
    return model


def _prepare_nf4_weights(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Ready a QLoRA base's NF4 weights (models/shared/nf4.py), quantised whole, for FSDP: those whose rows split into
    whole scale groups over the shard ranks are sharded like any weight (their per-tensor constants placed on the
    device, shared by the shards); the others, which FSDP cannot pad, stay whole on every rank: returned (and
    logged) for FSDP to leave out."""
    ids = {id(p) for p in nf4_weights(model)}
    nf4 = {name: p for name, p in model.named_parameters() if id(p) in ids}
    whole = {name for name, p in nf4.items() if not nf4_shardable(tuple(p.shape), mesh.size(-1))}
    for name, p in nf4.items():
        if name not in whole:
            place_nf4_constants(p, mesh.device_type)
    if whole:
        names = sorted(canonical_name(name) for name in whole)
        logger.info(f"lora: {len(whole)} of the {len(nf4)} NF4 base weights stay whole on every rank: their rows do "
                    f"not split into whole scale groups (64 x 256 values) over {mesh.size(-1)} FSDP ranks "
                    f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})")
    return {nf4[name] for name in whole}


def _expert_shard_placement(experts: GroupedExperts, expert_mesh: DeviceMesh):
    # The local experts split over the FSDP ranks by expert when they divide evenly, else along the model
    # width (FSDP would otherwise pad whole experts): dimension 1 of w1, w3 (E, dim, hidden), 2 of w2 (E,
    # hidden, dim); the hidden width is tensor parallelism's.
    ranks = expert_mesh.size(-1)

    def placement(param: nn.Parameter) -> Shard:
        local_experts = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        if local_experts % ranks == 0:
            return Shard(0)
        return Shard(2 if param is experts.w2 else 1)

    return placement


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Replicate the model over ``mesh`` with FSDP2's ``replicate``: one gradient all-reduce per block,
    overlapping backward, controlled like FSDP's (pipeline stages and gradient accumulation defer it the
    same way; see ``set_gradient_sync``). Gradients are summed for the same reason as in FSDP."""
    # A QLoRA base's NF4 weights are frozen and the same on every rank: nothing to replicate or reduce.
    ignored = {"ignored_params": nf4_weights(model)} if nf4_weights(model) else {}
    for block in model.layers.values():
        replicate(block, mesh=mesh, **ignored)
    replicate(model, mesh=mesh, **ignored)
    _sum_gradients_on_every_unit(model)
    return model


def _sum_gradients_on_every_unit(model: nn.Module) -> None:
    # The loss is already divided by the global token count, so ranks' gradients must be summed, not
    # averaged. Forcing a plain sum also avoids ReduceOp.PREMUL_SUM, which gloo does not have.
    # Both settings are per unit, so set them on every unit, not only the root.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(model_parts: list[nn.Module], last_microbatch: bool) -> None:
    """All-reduce gradients across replicas (DDP, HSDP) only in the step's last micro-batch's backward.

    Before it, FSDP2 keeps summing the micro-batches' (reduce-scattered) gradients locally and the last
    all-reduce carries them all, so a step costs one replica all-reduce whatever the accumulation. FSDP's
    reduce-scatter still runs per micro-batch, which keeps gradients sharded between micro-batches.
    """
    for part in model_parts:
        if isinstance(part, FSDPModule):
            part.set_requires_all_reduce(last_microbatch, recurse=True)
