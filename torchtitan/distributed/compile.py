"""torch.compile applied per block, so one compiled graph serves every identical layer."""

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def _wait_for_collectives(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # A tensor-parallel layer in front of a block (the embeddings) returns its output while the
    # reduce-scatter is still in flight (an AsyncCollectiveTensor). Fed to a compiled block, AOTAutograd
    # hands back a gradient of the wrong kind for it and the backward crashes (torch 2.13); a plain copy
    # taken outside the compiled region avoids that.
    def plain(a):
        return a.clone() if isinstance(a, AsyncCollectiveTensor) else a

    return tuple(plain(a) for a in args), {name: plain(a) for name, a in kwargs.items()}


def apply_compile(model: nn.Module, backend: str, fullgraph: bool = True) -> None:
    """``fullgraph=False`` lets a block call eager code (context-parallel attention's collectives)."""
    for name, block in list(model.layers.items()):
        compiled = torch.compile(block, backend=backend, fullgraph=fullgraph)
        compiled.register_forward_pre_hook(_wait_for_collectives, with_kwargs=True)
        model.layers.register_module(name, compiled)
    tower = getattr(model, "visual", None)
    if tower is not None:
        # A vision block's attention runs image by image, a loop over a batch's own image sizes that a graph would
        # specialise on: its MLP is compiled (dynamic in the patch count), the attention stays eager.
        for block in tower.blocks.values():
            block.mlp = torch.compile(block.mlp, backend=backend, fullgraph=True, dynamic=True)
