"""LoRA adapters in PEFT's format: a folder with adapter_config.json and adapter_model.safetensors, which
``peft.PeftModel.from_pretrained`` puts on top of the transformers model of our Hugging Face export.

PEFT names an adapter by its base module's Hugging Face name: ours ``layers.3.attention.wq.lora_a.weight``
(on ``layers.3.attention.wq.weight``, Hugging Face ``model.layers.3.self_attn.q_proj.weight``) is PEFT's
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. B's rows are the base's output features,
so they take whatever layout change the base's rows take (the q/k RoPE permutation); A's columns are input
features, which no family permutes. The scale is lora_alpha / r, as ours; rank_pattern and alpha_pattern give
modules their own r and lora_alpha (PEFT's rule: the first key, in order, that matches the end of the module's
name after a dot, as a regular expression).

Only plain LoRA imports: every other adapter_config.json field that changes what the adapter computes (DoRA,
rsLoRA, trained biases or whole modules, base weights PEFT's init rewrites, ...) is refused by name, and so is
a field this reader does not know, unless it is off.
"""

import json
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchtitan.components.checkpointing.hf_folder import read_safetensors_file
from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.hardware import DTYPES
from torchtitan.models.shared.lora import AdapterSetting, merge_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_OURS = re.compile(r"^(.+)\.lora_([ab])\.weight$")
_PEFT = re.compile(r"^(.+)\.lora_([AB])\.weight$")
# Fields read here: the ranks, the scales and which modules are adapted.
_READ = {"peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
         "layers_to_transform", "layers_pattern", "init_lora_weights"}
# Fields that leave the computation of the loaded adapter alone: where it came from, how PEFT builds, initialises
# or trains it (the run's own lora.dropout applies; VeLoRA changes PEFT's backward only).
_NEUTRAL = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
            "lora_dropout", "megatron_config", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
            "corda_config", "lora_ga_config", "velora_config", "runtime_config", "ensure_weight_tying"}
# init_lora_weights values after which PEFT's load rewrites the base weights (the adapter computes on that
# residual, not on the base), or keeps B frozen where lora here trains it.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "mica")


def _off(value) -> bool:
    """Whether a field holds its 'not used' value (PEFT's defaults for the fields that change the computation)."""
    return value is None or value is False or value == "none" or (isinstance(value, (list, dict)) and not value)


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


def _hf_module(hf_adapter, module: str) -> str:
    return hf_adapter.hf_name(f"{module}.weight").removesuffix(".weight")


def peft_settings(settings: dict[str, AdapterSetting], hf_adapter) -> dict:
    """adapter_config.json's r, lora_alpha, rank_pattern, alpha_pattern and lora_dropout for adapters of these
    (per module) settings: r and lora_alpha are the most common, the patterns name each other module exactly."""
    r = Counter(s.rank for s in settings.values()).most_common(1)[0][0]
    alpha = Counter(s.alpha for s in settings.values()).most_common(1)[0][0]
    exact = {module: re.escape(_hf_module(hf_adapter, module)) for module in sorted(settings)}
    return {"r": r, "lora_alpha": alpha,
            "rank_pattern": {exact[m]: s.rank for m, s in sorted(settings.items()) if s.rank != r},
            "alpha_pattern": {exact[m]: s.alpha for m, s in sorted(settings.items()) if s.alpha != alpha},
            "lora_dropout": Counter(s.dropout for s in settings.values()).most_common(1)[0][0]}


def write_peft_adapter(folder: Path, state: dict[str, torch.Tensor], hf_adapter, settings: dict[str, AdapterSetting],
                       dtype: str, base_model: str = "") -> int:
    """Write our full (unsharded) adapter tensors as a PEFT adapter folder; returns the tensors written.
    ``settings``: each adapted module's rank, alpha and dropout (models/shared/lora.py adapter_settings);
    ``base_model`` is recorded as base_model_name_or_path (where the base export is)."""
    peft = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in to_peft(state, hf_adapter).items()}
    modules = sorted({k.removeprefix(_PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in peft})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        **peft_settings(settings, hf_adapter), "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return len(peft)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module value: that of the first key matching the end of ``module`` after a dot, else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _in_names(names, module: str) -> bool:
    """PEFT's target_modules/exclude_modules rule: a string is a regular expression for the whole name, a list
    holds whole names and name endings after a dot."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return module in names or any(module.endswith(f".{name}") for name in names)


def _targeted(config: dict, module: str) -> bool:
    """Whether PEFT puts an adapter on the Hugging Face module ``module`` under this adapter_config."""
    targets, layers = config["target_modules"], config.get("layers_to_transform")
    if config.get("exclude_modules") and _in_names(config["exclude_modules"], module):
        return False
    if isinstance(targets, str) or module in targets:  # layers_to_transform narrows list endings only
        return _in_names(targets, module)
    if not _in_names(targets, module):
        return False
    if layers is None or layers == []:
        return True
    # The layer index is the first number after a named segment (layers_pattern's name, if given).
    patterns = config.get("layers_pattern") or None
    patterns = [patterns] if isinstance(patterns, str) else patterns
    match = None
    for pattern in patterns or [None]:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.",
                         module)
        if match:
            break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _refuse_unplain(config: dict, config_file: Path) -> None:
    """Refuse, naming the field, what a plain LoRA import would compute differently from PEFT."""
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {config['peft_type']!r} is not LORA")
    for key, value in config.items():
        if key in _READ or key in _NEUTRAL or _off(value):
            continue
        raise CheckpointError(f"{config_file}: {key} = {json.dumps(value)} is not supported (plain LoRA only: "
                              f"{key} changes what the adapter computes, or is a field this reader does not know)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise CheckpointError(f"{config_file}: init_lora_weights = {init!r} is not supported: PEFT rewrites the base "
                              "weights or freezes B for it; convert the adapter to plain LoRA with PEFT first")
    if config.get("target_modules") is None or config["target_modules"] == "all-linear":
        raise CheckpointError(f"{config_file}: target_modules = {json.dumps(config.get('target_modules'))}: PEFT "
                              "resolves it by architecture; name the modules (as PEFT's save_pretrained writes them)")
    for key, kind in (("r", int), ("rank_pattern", int), ("lora_alpha", (int, float)), ("alpha_pattern", (int, float))):
        values = (config.get(key) or {}) if key.endswith("_pattern") else {key: config[key]}
        if not isinstance(values, dict) or not all(isinstance(v, kind) and not isinstance(v, bool) and v > 0
                                                   for v in values.values()):
            raise CheckpointError(f"{config_file}: {key} = {json.dumps(config.get(key))} is invalid; ranks are "
                                  "integers >= 1, alphas numbers > 0 (the patterns map module names to them)")


def read_peft_adapter(folder: Path, hf_adapter, rank: int, alpha: float, modules: list[str]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, float]]]:
    """A PEFT adapter folder's tensors under our names and each adapted module's (rank, alpha) (ours), refused in
    one line unless it is a plain LoRA adapter whose r and lora_alpha are ``rank`` and ``alpha`` (what this run's
    [lora] section says; rank_pattern and alpha_pattern may set other values per module) and whose tensors are
    exactly those of the modules PEFT would adapt among the model's ``modules`` (ours: its Linear and Embedding
    layers, the kinds PEFT adapts here)."""
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
    config = {"r": 8, "lora_alpha": 8, **config}  # PEFT's defaults where they are left out
    _refuse_unplain(config, config_file)
    if config["r"] != rank or float(config["lora_alpha"]) != float(alpha):
        raise CheckpointError(f"{config_file}: r = {config['r']}, lora_alpha = {config['lora_alpha']}, but "
                              f"this run has lora.rank = {rank}, lora.alpha = {alpha:g}; set them to the adapter's")
    state = from_peft(read_safetensors_file(weights_file), hf_adapter)
    adapted = {name.rsplit(".lora_", 1)[0] for name in state}
    # PEFT adapts the modules target_modules names and loads the file's tensors into them: a module it adapts
    # that the file lacks keeps PEFT's initialisation, one the file has that it does not adapt is dropped.
    hf_names = {}
    for module in modules:
        try:
            hf_names[module] = _hf_module(hf_adapter, module)
        except KeyError:  # no Hugging Face module of its own
            continue
    try:
        targeted = {module for module, hf in hf_names.items() if _targeted(config, hf)}
        settings = {module: (_pattern_value(config.get("rank_pattern") or {}, hf, rank),
                             float(_pattern_value(config.get("alpha_pattern") or {}, hf, alpha)))
                    for module, hf in ((m, _hf_module(hf_adapter, m)) for m in adapted)}
    except re.error as e:
        raise CheckpointError(f"{config_file}: a module pattern is not a regular expression ({e}); fix "
                              "target_modules, exclude_modules, layers_pattern, rank_pattern or alpha_pattern") from None
    if diff := sorted(targeted ^ adapted):
        module = diff[0]
        hf = hf_names.get(module) or _hf_module(hf_adapter, module)
        raise CheckpointError(f"{config_file}: target_modules = {json.dumps(config['target_modules'])} "
                              + (f"adapts {hf}, whose tensors {ADAPTER_WEIGHTS} lacks" if module in targeted else
                                 f"does not adapt {hf}, which {ADAPTER_WEIGHTS} holds tensors for")
                              + " (exclude_modules, layers_to_transform and layers_pattern narrow it)")
    return state, settings


def write_lora_export(folder: Path, state: dict[str, torch.Tensor], hf_adapter,
                      settings: dict[str, AdapterSetting], base_frozen: bool, dtype: str, base_model: str,
                      write_model) -> int:
    """A LoRA run's Hugging Face export of its full ``state`` (``settings``: every adapter's, adapter_settings):
    with the base frozen, the adapters as a PEFT folder (the base's own folder is the rest); with
    lora.train_base, the model with the adapters merged in, through ``write_model(folder, state)``. Returns the
    tensors written."""
    if base_frozen:
        return write_peft_adapter(folder, state, hf_adapter, settings, dtype, base_model)
    return write_model(folder, merge_adapters(state, settings))
