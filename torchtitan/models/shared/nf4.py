"""QLoRA's base in 4 bits: torchao's NF4Tensor (NormalFloat codes per 64 values, their absmax scales double-quantised
in groups of 256: about 0.52 bytes per weight), which weights hold it, and how a whole value is put into one that
FSDP may shard.

NF4's second-level scales are statistics of the whole tensor, so a weight is always quantised whole, then sliced
by rows: a slice holding whole scale groups is exactly those rows of the whole quantisation (``nf4_shardable``),
and every layout computes with the single process's base. models/ does not import torchao: an NF4 tensor is told
by its type's name and built by its own class (seeded_init.assign_whole_).
"""

import math

import torch
from torch import nn

# torchao's NF4 layout (the QLoRA paper's): absmax scales per 64 values, themselves quantised in groups of 256.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
# NF4Tensor's parts (torchao's attribute names): the codes, the scales and the scales' factors run along the rows,
# so a slice of rows holding whole scale groups is a slice of each; the scales' mean (over the whole tensor) and the
# 16-value code book are the same in every slice.
_NF4_SLICED = ("quantized_data", "quantized_scalers", "quantization_factor")
_NF4_CONSTANTS = ("scaler_mean", "nf4")


def mark_nf4(linear: nn.Linear) -> None:
    """Mark a frozen Linear whose weight is stored as NF4 (QLoRA). Its weight is always quantised from the whole
    weight (NF4's second-level scales are statistics of the whole tensor), then sharded if FSDP shards it
    (``nf4_shardable``); so every layout computes with the single process's exact base."""
    linear.nf4_weight = True


def nf4_shardable(shape: tuple[int, ...], degree: int) -> bool:
    """Whether an NF4 weight of ``shape`` splits into ``degree`` slices of rows that each hold whole scale groups
    (NF4_BLOCK x NF4_SCALER_BLOCK values): FSDP's shards of it, which cannot be padded."""
    return shape[0] % degree == 0 and math.prod(shape) % (NF4_BLOCK * NF4_SCALER_BLOCK * degree) == 0


def place_nf4_constants(weight, device: torch.device | str) -> None:
    """Give an NF4 weight built on the meta device real tensors for its per-tensor constants, on ``device``: the
    slices FSDP makes of it share them, so that ``set_nf4_`` filling them reaches every slice."""
    for name in _NF4_CONSTANTS:
        setattr(weight, name, torch.zeros_like(getattr(weight, name), device=device))


def set_nf4_(target, value) -> None:
    """Make the NF4 tensor ``target`` hold the NF4 tensor ``value`` (same shape and blocks): its sliced parts copied
    in place (they may be a slice FSDP manages), its constants copied in place where they are real tensors on the
    target's device, else replaced (a weight materialised without ``place_nf4_constants``)."""
    for name in _NF4_SLICED:
        getattr(target, name).copy_(getattr(value, name))
    device = target.quantized_data.device
    for name in _NF4_CONSTANTS:
        mine, theirs = getattr(target, name), getattr(value, name)
        if mine.device == device:
            mine.copy_(theirs)
        else:
            setattr(target, name, theirs.to(device))


def nf4_bytes(tensor) -> int:
    """Bytes an NF4 tensor (or a slice) holds in its sliced parts: what sharding divides."""
    return sum(getattr(tensor, name).nbytes for name in _NF4_SLICED)


def nf4_modules(model: nn.Module) -> list[nn.Module]:
    """The Linears ``mark_nf4`` marked."""
    return [m for m in model.modules() if getattr(m, "nf4_weight", False)]


def nf4_weights(model: nn.Module) -> set[nn.Parameter]:
    """The weights ``mark_nf4`` marked."""
    return {m.weight for m in nf4_modules(model)}


def is_nf4(tensor) -> bool:
    """Whether a tensor is torchao's NF4Tensor (told by name: models/ does not import torchao)."""
    return type(tensor).__name__ == "NF4Tensor"


def dequantized(tensor):
    """An NF4 weight's values as a plain tensor (in its original dtype); any other tensor as it is."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor
