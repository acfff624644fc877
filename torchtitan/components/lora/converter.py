"""LoRA fine-tuning, registered as the model converter "lora" (``model.converters = ["lora"]``, section [lora]).

On the meta model, before any parallelism, the Linear layers named by ``lora.targets`` get adapters
(models/shared/lora.py) and every other parameter is frozen unless ``lora.train_base``: frozen weights get no
gradient and no optimizer state, FSDP reduces no gradient for them, and checkpoints leave them out (they come
from checkpoint.initial_load_path again on resume; components/checkpointing/checkpoint.py). Tensor parallelism splits each
adapter with its base (distributed/tensor_parallel.py).
"""

import math
import re
from fnmatch import fnmatch
from pathlib import Path

import torch
from torch import nn

from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.components.lora.peft_adapter import read_peft_adapter
from torchtitan.config import ConfigError
from torchtitan.config.job_config import LoRA as LoRAConfig
from torchtitan.log import logger, quiet_torchao_import
from torchtitan.models.shared.lora import add_adapter, is_adapted, is_adapter_param
from torchtitan.models.shared.nf4 import NF4_BLOCK, NF4_SCALER_BLOCK, mark_nf4, nf4_weights
from torchtitan.models.shared.seeded_init import canonical_name, init_param_
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.protocols.train_spec import get_train_spec

_IN_BLOCK = re.compile(r"^layers\.\d+\.(.+)$")


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4Tensor of ``weight`` (on the meta device: an empty one of its shape, filled at init)."""
    quiet_torchao_import()
    from torchao.quantization import to_nf4 as torchao_to_nf4

    return torchao_to_nf4(weight.contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)


def config_problems(cfg: LoRAConfig, converters: list[str], parallelism, cpu_offload: bool = False
                    ) -> list[tuple[str, str]]:
    """Problems with the [lora] section (and the converters' order) as (full key, reason) pairs."""
    problems = []
    if cfg.rank < 1:
        problems.append(("lora.rank", "is invalid; it must be >= 1"))
    if cfg.alpha <= 0:
        problems.append(("lora.alpha", "is invalid; it must be > 0"))
    if not 0 <= cfg.dropout < 1:
        problems.append(("lora.dropout", "is invalid; it must be in [0, 1)"))
    if not cfg.targets:
        problems.append(("lora.targets", "is empty; name the Linear layers to adapt, e.g. ['attention.*']"))
    if cfg.adapter_path is not None and not Path(cfg.adapter_path).is_dir():
        problems.append(("lora.adapter_path", "is not a folder (a PEFT adapter folder: adapter_config.json, "
                         "adapter_model.safetensors)"))
    if cfg.base_dtype == "nf4":
        if cfg.train_base:
            problems.append(("lora.train_base", "cannot train an NF4 base (lora.base_dtype = 'nf4' stores it "
                             "frozen in 4 bits); set lora.base_dtype = 'model' to train it"))
        for key in ("tensor_parallel_degree", "expert_parallel_degree"):
            if getattr(parallelism, key) > 1:
                problems.append((f"parallelism.{key}", "must be 1 with lora.base_dtype = 'nf4': the NF4 base is "
                                 "sharded by FSDP only (data parallelism, FSDP/HSDP and pipelining work)"))
        if cpu_offload:
            problems.append(("training.enable_cpu_offload", "cannot offload an NF4 base (lora.base_dtype = 'nf4'): "
                             "its per-tensor constants stay on the device FSDP gathers it on; leave one of them out"))
        if "float8" in converters:
            problems.append(("model.converters", "lists 'float8', whose matmuls need a high-precision weight; "
                             "lora.base_dtype = 'nf4' stores the base in 4 bits (use one or the other)"))
    if "float8" in converters and converters.index("float8") > converters.index("lora"):
        problems.append(("model.converters", "lists 'float8' after 'lora'; list it first, so the "
                         "base layers are float8 and the adapters wrap them"))
    return problems


def _kaiming_uniform(t: torch.Tensor, g: torch.Generator) -> None:
    # nn.Linear's default, which LoRA's A takes (and PEFT's adapters start from).
    nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)


class LoRAConverter:
    """Adds adapters to the target Linear layers and freezes the rest; see the module docstring."""

    def __init__(self, job_config, parallel_dims):
        self.cfg: LoRAConfig = job_config.lora
        self.model_name = job_config.model.name
        self._start: dict[str, torch.Tensor] | None = None  # the adapter folder's tensors, read once
        # (rank, alpha) of each module the adapter folder adapts (its rank_pattern/alpha_pattern may set some apart)
        self._settings: dict[str, tuple[int, float]] = {}

    def _targets(self, model: nn.Module) -> list[tuple[str, nn.Linear]]:
        """The (name, module) pairs the patterns name, refusing patterns that name nothing or what LoRA here
        does not adapt."""
        found = []
        for pattern in self.cfg.targets:
            hits = [(name, module) for name, module in model.named_modules()
                    if (m := _IN_BLOCK.match(name)) and fnmatch(m.group(1), pattern)]
            for name, module in hits:
                if name.endswith("router.gate"):
                    raise ConfigError(f"lora.targets: {pattern!r} matches the MoE router's gate ({name}), which is "
                                      "not adapted (it chooses the experts); narrow the pattern, e.g. "
                                      "'moe.shared_experts.*'")
                if any(p.dim() > 2 for p in module.parameters(recurse=False)):
                    raise ConfigError(f"lora.targets: {pattern!r} matches routed experts ({name}), whose stacked "
                                      "weights are not adapted; target attention and shared experts "
                                      "('moe.shared_experts.*')")
            linears = [(name, module) for name, module in hits if isinstance(module, nn.Linear)]
            if not linears:
                examples = sorted({_IN_BLOCK.match(n).group(1) for n, mod in model.named_modules()
                                   if isinstance(mod, nn.Linear) and _IN_BLOCK.match(n)})
                raise ConfigError(f"lora.targets: {pattern!r} matches no Linear layer in the model's blocks; they "
                                  f"are named {', '.join(examples)}")
            found += [pair for pair in linears if pair not in found]
        return found

    def convert(self, model: nn.Module) -> None:
        targets = self._targets(model)
        if self.cfg.adapter_path is not None:
            self._start = self._read_adapter(model, targets)
        for name, module in targets:
            add_adapter(module, *self._settings.get(name, (self.cfg.rank, self.cfg.alpha)), self.cfg.dropout)
        if self.cfg.base_dtype == "nf4":
            self._mark_nf4(model)
        total = trainable = 0
        for name, param in model.named_parameters():
            if not is_adapter_param(name):
                param.requires_grad_(self.cfg.train_base)
            total += param.numel()
            trainable += param.numel() if param.requires_grad else 0
        apart = sum(setting != (self.cfg.rank, self.cfg.alpha) for setting in self._settings.values())
        logger.info(f"lora: adapters of rank {self.cfg.rank} (alpha {self.cfg.alpha:g}) on {len(targets)} Linear layers"
                    + (f" ({apart} with their own, from the adapter's rank_pattern/alpha_pattern)" if apart else "")
                    + f"; trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%)"
                    + ("" if self.cfg.train_base else "; the base is frozen"))

    def _read_adapter(self, model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> dict[str, torch.Tensor]:
        """lora.adapter_path's tensors under our names, refused unless they adapt exactly the targets."""
        spec = get_train_spec(self.model_name)
        if spec.state_dict_adapter is None:
            raise ConfigError(f"lora.adapter_path: model.name = {self.model_name!r} has no Hugging Face names (its "
                              "TrainSpec has no state_dict_adapter), which PEFT adapters are keyed by")
        try:
            state, self._settings = read_peft_adapter(
                Path(self.cfg.adapter_path), spec.state_dict_adapter(model.args), self.cfg.rank, self.cfg.alpha,
                [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))])
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        shapes = {}
        for name, module in targets:
            rank = self._settings.get(name, (self.cfg.rank,))[0]
            shapes[f"{name}.lora_a.weight"] = (rank, module.in_features)
            shapes[f"{name}.lora_b.weight"] = (module.out_features, rank)
        if diff := sorted(shapes.keys() ^ state.keys()):
            where = "has no" if diff[0] in shapes else "adapts a layer lora.targets does not name:"
            raise ConfigError(f"lora.adapter_path {self.cfg.adapter_path} {where} {diff[0]}; set lora.targets to the "
                              "layers the adapter was trained on (lora.targets adapts them in every block: an adapter "
                              "on some blocks only, e.g. PEFT's layers_to_transform, does not import)")
        for name, shape in shapes.items():
            if tuple(state[name].shape) != shape:
                raise ConfigError(f"lora.adapter_path {self.cfg.adapter_path}: {name} has shape "
                                  f"{list(state[name].shape)}, but this model needs {list(shape)} (check model.flavor)")
        return state

    @staticmethod
    def _mark_nf4(model: nn.Module) -> None:
        """QLoRA: every block's Linear base weight that NF4 can hold (whole 64-value blocks, their scales in
        whole groups of 256) becomes an NF4 weight, on the meta device, in the stored dtype (the model was cast
        before conversion; a cast would dequantize it); the model's init fills it (seeded_init.assign_whole_).
        The router's gate stays (it chooses the experts)."""
        kept = []
        for name, module in model.named_modules():
            if not (_IN_BLOCK.match(name) and isinstance(module, nn.Linear)) or is_adapter_param(name + ".weight") \
                    or name.endswith("router.gate"):
                continue
            if module.weight.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK):
                kept.append(name)
            else:
                mark_nf4(module)
                module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
        logger.info(f"lora: the base's block Linear weights are stored in NF4 ({len(nf4_weights(model))} weights"
                    + (f"; kept in training.dtype, too small for NF4's blocks: {', '.join(kept)}" if kept else "")
                    + ")")

    def init_weights(self, model_part: nn.Module, seed: int) -> None:
        """A Kaiming-uniform, B zero (so the adapted model starts as its base), layout-independent (seeded_init);
        or lora.adapter_path's values."""
        with torch.no_grad():
            for name, module in model_part.named_modules():
                if not is_adapted(module):
                    continue
                name = canonical_name(name)
                if self._start is not None:
                    for side in ("lora_a", "lora_b"):
                        value = self._start[f"{name}.{side}.weight"]
                        init_param_(getattr(module, side).weight, f"{name}.{side}.weight", seed,
                                    lambda t, g, v=value: t.copy_(v))
                else:
                    init_param_(module.lora_a.weight, f"{name}.lora_a.weight", seed, _kaiming_uniform)
                    module.lora_b.weight.zero_()

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        pass


register_model_converter("lora", LoRAConverter)
