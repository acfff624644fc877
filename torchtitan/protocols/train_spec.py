"""TrainSpec: everything the trainer builds for one model family, and the registry of specs.

A custom model registers a spec under a new name (from its own package, imported through
``--experimental.custom_import``) and is then selected with ``--model.name``.
"""

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from torchtitan.protocols.model import BaseModelArgs
from torchtitan.registry import Registry


@dataclass
class TrainSpec:
    model_cls: type[nn.Module]
    """Built as ``model_cls(args)`` on the meta device."""
    flavors: dict[str, BaseModelArgs]
    """Named sizes of the family."""
    parallelize_fn: Callable[..., nn.Module]
    """``parallelize_fn(model, parallel_dims, job_config)`` applies TP, AC, compile and FSDP."""
    pipelining_fn: Callable[..., Any] | None = None
    """Splits the model into pipeline stages (None: the family does not support PP)."""
    build_optimizer_fn: Callable[..., Any] = field(default=None)  # type: ignore[assignment]
    build_lr_scheduler_fn: Callable[..., Any] = field(default=None)  # type: ignore[assignment]
    build_dataloader_fn: Callable[..., Any] = field(default=None)  # type: ignore[assignment]
    build_tokenizer_fn: Callable[..., Any] = field(default=None)  # type: ignore[assignment]
    build_loss_fn: Callable[..., Any] = field(default=None)  # type: ignore[assignment]
    build_validator_fn: Callable[..., Any] | None = None
    state_dict_adapter: type | None = None
    """Converts between this family's state dict and Hugging Face names (None: no HF interop)."""

    def __post_init__(self) -> None:
        # Families that do not bring their own builders get the standard ones.
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.components.lr_scheduler import build_lr_scheduler
        from torchtitan.components.optimizer import build_optimizer
        from torchtitan.data import build_dataloader, build_tokenizer

        defaults = {
            "build_optimizer_fn": build_optimizer,
            "build_lr_scheduler_fn": build_lr_scheduler,
            "build_dataloader_fn": build_dataloader,
            "build_tokenizer_fn": build_tokenizer,
            "build_loss_fn": build_cross_entropy_loss,
        }
        for name, fn in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, fn)


TRAIN_SPECS: Registry[TrainSpec] = Registry("model", builtin_modules=("torchtitan.models",))


def register_train_spec(name: str, spec: TrainSpec) -> None:
    """Make ``spec`` selectable as ``model.name = name``; registering a name twice is an error."""
    TRAIN_SPECS.register(name, spec)


def get_train_spec(name: str) -> TrainSpec:
    return TRAIN_SPECS.get(name)


def registered_train_specs() -> list[str]:
    return TRAIN_SPECS.names()
