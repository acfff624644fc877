"""torch.compile applied per block, so one compiled graph serves every identical layer."""

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def _wait_for_collectives(module: nn.Module, args: tuple) -> tuple:
    # A tensor-parallel layer in front of a block (the embeddings) returns its output while the
    # reduce-scatter is still in flight (an AsyncCollectiveTensor). Fed to a compiled block, AOTAutograd
    # hands back a gradient of the wrong kind for it and the backward crashes (torch 2.13); a plain copy
    # taken outside the compiled region avoids that.
    return tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def apply_compile(model: nn.Module, backend: str, fullgraph: bool = True) -> None:
    """``fullgraph=False`` lets a block call eager code (context-parallel attention's collectives)."""
    for name, block in list(model.layers.items()):
        compiled = torch.compile(block, backend=backend, fullgraph=fullgraph)
        compiled.register_forward_pre_hook(_wait_for_collectives)
        model.layers.register_module(name, compiled)
