"""Activation checkpointing of the blocks under ``model.layers``."""

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str, preserve_rng_state: bool) -> None:
    """Recompute block activations in backward: every block ("full") or every N-th ("selective")."""
    if mode == "none":
        return
    if mode == "selective" and selective_ac_option == "op":
        raise NotImplementedError("activation_checkpoint.selective_ac_option = 'op' is not available yet")
    every = 1 if mode == "full" else int(selective_ac_option)
    for index, (name, block) in enumerate(list(model.layers.items())):
        if index % every == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state, use_reentrant=False)
            model.layers.register_module(name, wrapped)
