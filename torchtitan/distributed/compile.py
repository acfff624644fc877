"""torch.compile applied per block, so one compiled graph serves every identical layer."""

import torch
from torch import nn


def apply_compile(model: nn.Module, backend: str, fullgraph: bool = True) -> None:
    """``fullgraph=False`` lets a block call eager code (context-parallel attention's collectives)."""
    for name, block in list(model.layers.items()):
        model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=fullgraph))
