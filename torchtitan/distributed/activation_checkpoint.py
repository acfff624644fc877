"""Activation checkpointing of the blocks under ``model.layers``.

Modes: "full" recomputes every block in backward; "selective" with an integer N recomputes every
N-th block; "selective" with "op" keeps the outputs of attention and of every second matmul in each
block and recomputes the rest (cheap element-wise ops and the other matmuls).
"""

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

_ATTENTION_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
               torch.ops.aten._grouped_mm.default}


# Per-op checkpointing replays a block's ops in backward and requires the same op sequence as in forward.
# Profiler ranges are not computation, but FSDP opens a different number of them when it all-gathers a unit
# nested inside a block (a MoE's experts under expert parallelism) during the recomputation; leave them out
# of the comparison, as torch leaves out detach.
SAC_IGNORED_OPS.update(getattr(packet, overload) for packet, overloads in (
    (torch.ops.profiler._record_function_enter_new, ("default",)),
    (torch.ops.profiler._record_function_exit, ("default", "_RecordFunction"))) for overload in overloads
    if overload in packet.overloads())


def _op_policy():
    """Save attention outputs and every second matmul output; recompute everything else."""
    matmuls_seen = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMUL_OPS:
            # Count forward and recompute separately so both passes make the same choices.
            key = "recompute" if ctx.is_recompute else "forward"
            matmuls_seen[key] += 1
            if matmuls_seen[key] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str, preserve_rng_state: bool) -> None:
    if mode == "none":
        return
    per_op = mode == "selective" and selective_ac_option == "op"
    every = 1 if mode == "full" or per_op else int(selective_ac_option)
    # A vision tower's blocks (models/shared/vision.py) are checkpointed like the decoder's.
    tower = getattr(model, "visual", None)
    for stack in [model.layers, *([tower.blocks] if tower is not None else [])]:
        for index, (name, block) in enumerate(list(stack.items())):
            if index % every:
                continue
            kwargs = {"context_fn": _op_policy} if per_op else {}
            wrapped = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=preserve_rng_state, **kwargs
            )
            stack.register_module(name, wrapped)
