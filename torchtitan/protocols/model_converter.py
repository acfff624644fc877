"""Model converters: named transformations applied to the model before parallelism (e.g. float8).

A converter is registered under a name users put in ``model.converters``; the trainer applies them in
that order to the meta-device model, and calls each one's post-optimizer hook after every step.
"""

from typing import Protocol

from torch import nn


class ModelConverter(Protocol):
    def __init__(self, job_config, parallel_dims): ...

    def convert(self, model: nn.Module) -> None:
        """Change the model in place (it is still on the meta device, before TP/AC/compile/FSDP)."""

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        """Work needed after each optimizer step (e.g. refreshing cached scales)."""


_CONVERTERS: dict[str, type] = {}


def register_model_converter(name: str, converter_cls: type) -> None:
    """Make ``converter_cls`` selectable as ``model.converters = [name]``; a name can be registered once."""
    if name in _CONVERTERS:
        raise ValueError(f"a model converter named '{name}' is already registered")
    _CONVERTERS[name] = converter_cls


def registered_model_converters() -> list[str]:
    _register_builtin_converters()
    return sorted(_CONVERTERS)


class ModelConverters:
    """The converters named in the config, applied in order."""

    def __init__(self, names: list[str], job_config, parallel_dims):
        _register_builtin_converters()
        unknown = [n for n in names if n not in _CONVERTERS]
        if unknown:
            raise KeyError(f"unknown model converters {unknown}; registered: {', '.join(sorted(_CONVERTERS))}")
        self.converters = [_CONVERTERS[n](job_config, parallel_dims) for n in names]

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(model_parts)


def _register_builtin_converters() -> None:
    # Imported for its registration side effect, only when converters are asked about.
    import torchtitan.components.float8  # noqa: F401
