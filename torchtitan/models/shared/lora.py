"""Low-rank adapters (LoRA, Hu et al. 2021): y = base(x) + (alpha / r) * B(A(dropout(x))).

A layer keeps its class's own forward for the base (a plain or a float8 Linear) and its ``weight`` under the
same name, so checkpoints and Hugging Face names of the base are unchanged; the adapter is two child Linears,
``lora_a`` (r x in) and ``lora_b`` (out x r). B starts at zero, so an adapted model starts as its base. Each
layer has its own r and alpha (an imported PEFT adapter may set them per module: rank_pattern, alpha_pattern).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from torch import nn

from torchtitan.models.shared.nf4 import dequantized
from torchtitan.models.shared.seeded_init import canonical_name

_ADAPTED_CLASSES: dict[type, type] = {}


class LoRAForward:
    """Mixed in ahead of a Linear class: its output plus the adapter's."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_alpha: float
    lora_scale: float
    lora_off: bool = False  # adapters_off: the base alone

    def forward(self, x):
        if self.lora_off:
            return super().forward(x)
        return super().forward(x) + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scale


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model alone inside the block (every adapter of ``model`` skipped), e.g. RL's frozen reference."""
    adapted = [m for m in model.modules() if is_adapted(m)]
    for m in adapted:
        m.lora_off = True
    try:
        yield
    finally:
        for m in adapted:
            m.lora_off = False


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
    linear.lora_alpha = alpha  # kept as given: exports write it (alpha / rank * rank need not give it back)
    linear.lora_scale = alpha / rank


def is_adapted(module: nn.Module) -> bool:
    return isinstance(module, LoRAForward)


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (any prefix) is an adapter's."""
    return ".lora_a." in f".{name}" or ".lora_b." in f".{name}"


class AdapterSetting(NamedTuple):
    rank: int
    alpha: float
    dropout: float


def adapter_settings(model: nn.Module) -> dict[str, AdapterSetting]:
    """{module name (canonical): its rank, alpha and dropout} of every adapted Linear of ``model``."""
    return {canonical_name(name): AdapterSetting(
                m.lora_a.out_features, m.lora_alpha,
                m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0)
            for name, m in model.named_modules() if is_adapted(m)}


def merge_adapters(state: dict, settings: dict[str, AdapterSetting]) -> dict:
    """A full state dict with each adapter folded into its base, W + (alpha / rank) * B @ A (in float32, each
    module's (rank, alpha) from ``settings``, as ``adapter_settings`` gives them), and the adapters dropped: the
    plain model's weights (an NF4 base dequantised)."""
    merged = {name: dequantized(t) for name, t in state.items() if not is_adapter_param(name)}
    for name, a in state.items():
        if name.endswith(".lora_a.weight"):
            module = name.removesuffix(".lora_a.weight")
            rank, alpha, _ = settings[module]
            b, w = state[f"{module}.lora_b.weight"], dequantized(state[f"{module}.weight"])
            merged[f"{module}.weight"] = (w.float() + (alpha / rank) * (b.float() @ a.float())).to(w.dtype)
    return merged
