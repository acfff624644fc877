"""Low-rank adapters (LoRA, Hu et al. 2021): y = base(x) + (alpha / r) * B(A(dropout(x))).

A layer keeps its class's own forward for the base (a plain or a float8 Linear) and its ``weight`` under the
same name, so checkpoints and Hugging Face names of the base are unchanged; the adapter is two child Linears,
``lora_a`` (r x in) and ``lora_b`` (out x r). B starts at zero, so an adapted model starts as its base.
"""

import math

import torch
from torch import nn

_ADAPTED_CLASSES: dict[type, type] = {}
# torchao's NF4 layout (the QLoRA paper's): absmax scales per 64 values, themselves quantised in groups of 256.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
# NF4Tensor's parts (torchao's attribute names): the codes, the scales and the scales' factors run along the rows,
# so a slice of rows holding whole scale groups is a slice of each; the scales' mean (over the whole tensor) and the
# 16-value code book are the same in every slice.
_NF4_SLICED = ("quantized_data", "quantized_scalers", "quantization_factor")
_NF4_CONSTANTS = ("scaler_mean", "nf4")


class LoRAForward:
    """Mixed in ahead of a Linear class: its output plus the adapter's."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scale


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Give ``linear`` (in place) an adapter of rank ``rank`` on the same device and dtype as its weight."""
    cls = type(linear)
    if cls not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAForward, cls), {})
    linear.__class__ = _ADAPTED_CLASSES[cls]
    factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
    linear.lora_a = nn.Linear(linear.in_features, rank, bias=False, **factory)
    linear.lora_b = nn.Linear(rank, linear.out_features, bias=False, **factory)
    # nn.Identity when off: a zero-probability dropout still dispatches a random op (and DTensor's RNG tracking).
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.lora_scale = alpha / rank


def is_adapted(module: nn.Module) -> bool:
    return isinstance(module, LoRAForward)


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


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (any prefix) is an adapter's."""
    return ".lora_a." in f".{name}" or ".lora_b." in f".{name}"


def adapter_settings(model: nn.Module) -> tuple[int, float, float]:
    """(rank, alpha, dropout) of the model's adapters, which one LoRA converter made alike."""
    module = next(m for m in model.modules() if is_adapted(m))
    dropout = module.lora_dropout.p if isinstance(module.lora_dropout, nn.Dropout) else 0.0
    rank = module.lora_a.out_features
    return rank, module.lora_scale * rank, dropout


def merge_adapters(state: dict, scale: float) -> dict:
    """A full state dict with each adapter folded into its base, W + scale * B @ A (in float32), and the adapters
    dropped: the plain model's weights (an NF4 base dequantised)."""
    merged = {name: dequantized(t) for name, t in state.items() if not is_adapter_param(name)}
    for name, a in state.items():
        if name.endswith(".lora_a.weight"):
            module = name.removesuffix(".lora_a.weight")
            b, w = state[f"{module}.lora_b.weight"], dequantized(state[f"{module}.weight"])
            merged[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged
