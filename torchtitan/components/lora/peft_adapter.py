"""LoRA adapters in PEFT's format: a folder with adapter_config.json and adapter_model.safetensors, which
``peft.PeftModel.from_pretrained`` puts on top of the transformers model of our Hugging Face export.

PEFT names an adapter by its base module's Hugging Face name: ours ``layers.3.attention.wq.lora_a.weight``
(on ``layers.3.attention.wq.weight``, Hugging Face ``model.layers.3.self_attn.q_proj.weight``) is PEFT's
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. B's rows are the base's output features,
so they take whatever layout change the base's rows take (the q/k RoPE permutation); A's columns are input
features, which no family permutes. The scale is lora_alpha / r, as ours.
"""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.hardware import DTYPES
from torchtitan.log import one_line
from torchtitan.models.shared.lora import adapter_settings, merge_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_OURS = re.compile(r"^(.+)\.lora_([ab])\.weight$")
_PEFT = re.compile(r"^(.+)\.lora_([AB])\.weight$")


def to_peft(state: dict[str, torch.Tensor], hf_adapter) -> dict[str, torch.Tensor]:
    """Our adapter tensors (``…lora_a.weight``, ``…lora_b.weight``; other names are ignored) under PEFT's names."""
    out = {}
    for name, tensor in state.items():
        if not (m := _OURS.match(name)):
            continue
        base = f"{m.group(1)}.weight"
        module = hf_adapter.hf_name(base).removesuffix(".weight")
        out[f"{_PEFT_PREFIX}{module}.lora_{m.group(2).upper()}.weight"] = (
            hf_adapter.tensor_to_hf(base, tensor) if m.group(2) == "b" else tensor)
    return out


def from_peft(state: dict[str, torch.Tensor], hf_adapter) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors under our names and layouts."""
    out = {}
    for name, tensor in state.items():
        m = _PEFT.match(name.removeprefix(_PEFT_PREFIX))
        if not m:
            raise CheckpointError(f"{ADAPTER_WEIGHTS}: {name} is not a LoRA weight (lora_A or lora_B)")
        try:
            base = hf_adapter.our_name(f"{m.group(1)}.weight")
        except KeyError:
            raise CheckpointError(f"{ADAPTER_WEIGHTS}: {name} adapts {m.group(1)}, which this model "
                                  f"({hf_adapter.hf_architecture}) does not have") from None
        side = m.group(2).lower()
        out[f"{base.removesuffix('.weight')}.lora_{side}.weight"] = (
            hf_adapter.tensor_from_hf(base, tensor) if side == "b" else tensor)
    return out


def write_peft_adapter(folder: Path, state: dict[str, torch.Tensor], hf_adapter, rank: int, alpha: float,
                       dropout: float, dtype: str, base_model: str = "") -> int:
    """Write our full (unsharded) adapter tensors as a PEFT adapter folder; returns the tensors written.
    ``base_model`` is recorded as base_model_name_or_path (where the base export is)."""
    peft = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in to_peft(state, hf_adapter).items()}
    modules = sorted({k.removeprefix(_PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in peft})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return len(peft)


def read_peft_adapter(folder: Path, hf_adapter, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder's tensors under our names; refused in one line when it is not a plain LoRA adapter
    of rank ``rank`` and scale ``alpha / rank`` (what this run's [lora] section builds)."""
    folder = Path(folder)
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not (config_file.is_file() and weights_file.is_file()):
        raise CheckpointError(f"lora.adapter_path {folder}: a PEFT adapter folder holds {ADAPTER_CONFIG} and "
                              f"{ADAPTER_WEIGHTS}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); replace it") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} holds {type(config).__name__}, not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {config['peft_type']!r} is not LORA")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise CheckpointError(f"{config_file}: {key} = true is not supported (plain LoRA only)")
    if config.get("r") != rank or float(config.get("lora_alpha", 8)) != float(alpha):
        raise CheckpointError(f"{config_file}: r = {config.get('r')}, lora_alpha = {config.get('lora_alpha')}, but "
                              f"this run has lora.rank = {rank}, lora.alpha = {alpha:g}; set them to the adapter's")
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:  # safetensors' own error type is not importable under a stable name
        raise CheckpointError(f"{weights_file} is not a complete safetensors file ({one_line(e)}); replace it") \
            from None
    return from_peft(tensors, hf_adapter)


def write_lora_export(folder: Path, state: dict[str, torch.Tensor], hf_adapter, model: torch.nn.Module,
                      base_frozen: bool, dtype: str, base_model: str, write_model) -> int:
    """A LoRA run's Hugging Face export of its full ``state``: with the base frozen, the adapters as a PEFT
    folder (the base's own folder is the rest); with lora.train_base, the model with the adapters merged in,
    through ``write_model(folder, state)``. Returns the tensors written."""
    rank, alpha, dropout = adapter_settings(model)
    if base_frozen:
        return write_peft_adapter(folder, state, hf_adapter, rank, alpha, dropout, dtype, base_model)
    return write_model(folder, merge_adapters(state, alpha / rank))
