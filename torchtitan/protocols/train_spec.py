"""TrainSpec: everything the trainer builds for one model family, and the registry of specs.

A custom model registers a spec under a new name (from its own package, imported through
``--experimental.custom_import``) and is then selected with ``--model.name``.
"""

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from torchtitan.protocols.model import BaseModelArgs


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


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(name: str, spec: TrainSpec) -> None:
    """Make ``spec`` selectable as ``model.name = name``; registering a name twice is an error."""
    if name in _REGISTRY:
        raise ValueError(f"a TrainSpec named '{name}' is already registered")
    _REGISTRY[name] = spec


def get_train_spec(name: str) -> TrainSpec:
    _register_builtin_models()
    if name not in _REGISTRY:
        raise KeyError(f"no model named '{name}'; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_train_specs() -> list[str]:
    _register_builtin_models()
    return sorted(_REGISTRY)


def _register_builtin_models() -> None:
    # Imported for their registration side effect; deferred so this module imports cheaply.
    import torchtitan.models  # noqa: F401
