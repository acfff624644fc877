"""Weight initialisation that gives the same weights under every parallel layout.

Each parameter is drawn in full, on the CPU, from a generator seeded by (seed, parameter name),
then the slice this rank holds is copied in. The values therefore depend on neither the mesh, nor
the order modules are visited in, nor the device. A QLoRA base's NF4 weight is quantised from the whole
drawn weight, then sliced (``assign_whole_``, which loads of a base use too).
"""

import math
import zlib
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan.models.shared.nf4 import is_nf4, set_nf4_

FillFn = Callable[[torch.Tensor, torch.Generator], None]


# Wrappers that activation checkpointing and torch.compile put around modules add these to the names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The parameter's name as in the bare model, whatever wrappers were applied."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def generator_for(seed: int, name: str) -> torch.Generator:
    key = zlib.crc32(canonical_name(name).encode())
    return torch.Generator().manual_seed((seed * 1_000_003 + key) % (2**63))


@torch.no_grad()
def init_param_(param: torch.Tensor, name: str, seed: int, fill: FillFn) -> None:
    """Fill ``param`` (a plain tensor or a DTensor shard) with ``fill`` applied to its full shape."""
    full = torch.empty(param.shape, dtype=torch.float32)
    fill(full, generator_for(seed, name))
    assign_whole_(param, full)


@torch.no_grad()
def assign_whole_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give ``param`` (a plain tensor, a DTensor shard, or an NF4 weight, whole or sharded) the value ``full``, the
    whole tensor, the same on every rank: each rank keeps its slice. An NF4 weight is quantised from the whole
    value once, then sliced, so every layout holds the single process's exact codes and scales."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if is_nf4(local):
        whole = type(local).from_tensor(full.to(local.quantized_data.device, local.dtype), local.block_size,
                                        local.scaler_block_size)
        set_nf4_(local, _local_rows(whole, param) if isinstance(param, DTensor) else whole)
        return
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so slice locally, no comms.
        full = distribute_tensor(
            full.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(full)


def _local_rows(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's slice of ``whole`` as ``like`` (a DTensor of whole rows: FSDP's Shard(0), replicated elsewhere)
    holds it."""
    for dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, f"a slice of rows is expected, not {placement}"
            whole = torch.chunk(whole, like.device_mesh.size(dim))[like.device_mesh.get_local_rank(dim)]
    return whole


def normal_(std: float, truncate: bool = True) -> FillFn:
    """A fill drawing from N(0, std^2), truncated at +-3 std by default."""

    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        if truncate:
            torch.nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=g)
        else:
            torch.nn.init.normal_(t, mean=0.0, std=std, generator=g)

    return fill


def scaled(fill: FillFn, factor: float) -> FillFn:
    """``fill``, then multiplied by ``factor`` (a normal's std times factor, truncation points included)."""

    def fill_scaled(t: torch.Tensor, g: torch.Generator) -> None:
        fill(t, g)
        t.mul_(factor)

    return fill_scaled


def ones_(t: torch.Tensor, g: torch.Generator) -> None:
    t.fill_(1.0)


def zeros_(t: torch.Tensor, g: torch.Generator) -> None:
    t.zero_()


def decoder_fill(name: str, dim: int, tie_embeddings: bool) -> FillFn:
    """The init of a Llama-style decoder's parameter by (canonical) name: biases 0, norms 1, embeddings N(0, 1) (or the
    output's scale when tied), output N(0, dim^-1/2), residual projections (wo, w2) shrinking with depth,
    every other weight N(0, 0.02)."""
    if name.endswith((".bias", "experts.b1", "experts.b2", "experts.b3")):
        return zeros_
    if "norm" in name:
        return ones_
    if name.startswith("tok_embeddings"):
        # A tied table is also the output projection, so it takes the output's scale.
        return normal_(dim**-0.5) if tie_embeddings else normal_(1.0, truncate=False)
    if name.startswith("output"):
        return normal_(dim**-0.5)
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        # Projections back into the residual stream shrink with depth to keep its variance bounded.
        layer_id = int(name.split(".")[1])
        return normal_(0.02 / math.sqrt(2 * (layer_id + 1)))
    return normal_(0.02)
