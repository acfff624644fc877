"""Model converters: named transformations applied to the model before parallelism (e.g. float8).

A converter is registered under a name users put in ``model.converters``; the trainer applies them in
that order to the meta-device model, lets each initialise what it added once the weights are materialised,
and calls each one's post-optimizer hook after every step.
"""

from typing import Protocol

from torch import nn

from torchtitan.registry import Registry


class ModelConverter(Protocol):
    def __init__(self, job_config, parallel_dims): ...

    def convert(self, model: nn.Module) -> None:
        """Change the model in place (it is still on the meta device, before TP/AC/compile/FSDP)."""

    def init_weights(self, model_part: nn.Module, seed: int) -> None:
        """Initialise the parameters the converter added, after the model's own init_weights (seeded_init)."""

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        """Work needed after each optimizer step (e.g. refreshing cached scales)."""


CONVERTERS: Registry[type] = Registry("model converter", builtin_modules=("torchtitan.components.float8",
                                                                          "torchtitan.components.lora.converter"))


def register_model_converter(name: str, converter_cls: type) -> None:
    """Make ``converter_cls`` selectable as ``model.converters = [name]``; a name can be registered once."""
    CONVERTERS.register(name, converter_cls)


def registered_model_converters() -> list[str]:
    return CONVERTERS.names()


def config_problems(names: list[str]) -> list[tuple[str, str]]:
    """model.converters naming a converter nobody registered, as a (field, reason) pair."""
    unknown = [n for n in names if n not in CONVERTERS]
    if unknown:
        return [("converters", f"names unknown converters {unknown}; registered: {', '.join(CONVERTERS.names())}")]
    return []


class ModelConverters:
    """The converters named in the config, applied in order."""

    def __init__(self, names: list[str], job_config, parallel_dims):
        # Config validation reports unknown names first (config_problems); the registry's KeyError names them too.
        self.converters = [CONVERTERS.get(n)(job_config, parallel_dims) for n in names]

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)

    def init_weights(self, model_part: nn.Module, seed: int) -> None:
        for converter in self.converters:
            converter.init_weights(model_part, seed)

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(model_parts)
