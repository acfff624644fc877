"""Load a trained model for generation, evaluation or a notebook, without a process group.

    model = torchtitan.load_model("train_configs/debug_model.toml", "outputs/checkpoint/step-100")
    logits = model(token_ids)  # [B, T] -> [B, T, vocab]

The checkpoint may be a DCP step folder (full or model-only export) or a Hugging Face folder
(config.json + *.safetensors); the kind is detected from its files.

``load_checkpoint`` also fills a tensor/expert-parallel model (generation/sharded.py) under torchrun: from a DCP
folder each rank reads only its own slices (DCP plans them from each DTensor's placement alone, ``no_dist``: every
rank reads the same folder), from a Hugging Face folder every rank reads the whole files and keeps its slices.
"""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from torchtitan.components.checkpointing.checkpoint import CheckpointError, load_state
from torchtitan.components.checkpointing.frozen_base import BaseFingerprint, frozen_names
from torchtitan.components.checkpointing.hf_folder import is_hf_folder, read_hf_model_state
from torchtitan.components.checkpointing.states import ModelState, load_model_state
from torchtitan.components.checkpointing.storage import verify_checkpoint
from torchtitan.components.lora.converter import LoRAConverter
from torchtitan.config.job_config import JobConfig
from torchtitan.config_check import load_model_config
from torchtitan.models.shared.lora import is_adapter_param
from torchtitan.protocols.train_spec import TrainSpec, build_model_args, get_train_spec
from torchtitan.remote import fetched_folder, filesystem, is_url


def build_model(cfg: JobConfig, device: torch.device | str = "cpu", mtp: bool = True) -> tuple[nn.Module, TrainSpec]:
    """The config's model, materialised and initialised from debug.seed, with its train spec (``mtp=False``:
    without multi-token prediction blocks); with LoRA adapters where the config trains them (model.converters)."""
    spec = get_train_spec(cfg.model.name)
    tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
    args = build_model_args(spec, cfg.model, tokenizer.vocab_size, cfg.training.seq_len, mtp=mtp)
    with torch.device("meta"):
        model = spec.model_cls(args)
    lora = LoRAConverter(cfg, None) if "lora" in cfg.model.converters else None
    if lora is not None:
        lora.convert(model)
    model.to_empty(device=device)
    model.init_weights(cfg.debug.seed, buffer_device=torch.device(device))
    if lora is not None:
        lora.init_weights(model, cfg.debug.seed)
    return model, spec


def load_hf_weights(model: nn.Module, spec: TrainSpec, folder: Path, include=lambda name: True) -> None:
    """The weights ``include(name)`` accepts (all by default) from a Hugging Face folder. A tensor/expert-parallel
    model (generation/sharded.py) takes them too: every rank reads the whole files and keeps its own slices."""
    if spec.state_dict_adapter is None:
        raise CheckpointError(f"model family has no Hugging Face adapter; cannot load {folder}")
    own = model.state_dict()
    expected = {name: tensor.shape for name, tensor in own.items() if include(name)}  # global shapes
    state = read_hf_model_state(folder, spec.state_dict_adapter(model.args), expected)
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in own]
    if missing or unexpected:
        raise CheckpointError(f"{folder} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    load_model_state([model], {name: t for name, t in state.items() if include(name)},
                     StateDictOptions(full_state_dict=True, strict=False))


def load_dcp_model(model: nn.Module, location: str | Path, include=lambda name: True) -> None:
    """Model weights (those ``include(name)`` accepts) from a DCP checkpoint folder or URL, checked against the
    model's names and shapes first."""
    state = ModelState([model], include, loading_only=True)
    if reason := state.refusal(verify_checkpoint(str(location))):
        raise CheckpointError(f"cannot load checkpoint {location}: {reason}")
    load_state({"model": state}, str(location), no_dist=True)


def _is_hf(location: str) -> bool:
    """Whether a local folder or URL is a Hugging Face folder (config.json beside the weights), not DCP."""
    if is_url(location):
        fs, path = filesystem(location)
        return fs.exists(f"{path.rstrip('/')}/config.json")  # a Hugging Face export uploaded by the trainer
    return is_hf_folder(Path(location))


def _load_weights(model: nn.Module, spec: TrainSpec, location: str, include=lambda name: True) -> None:
    """From a DCP or Hugging Face folder, local or at a URL; the kind is told by its files."""
    if not _is_hf(location):
        load_dcp_model(model, location, include)
    elif is_url(location):
        with fetched_folder(location, "config.json", "*.safetensors") as local:
            load_hf_weights(model, spec, local, include)
    else:
        load_hf_weights(model, spec, Path(location), include)


def load_checkpoint(model: nn.Module, spec: TrainSpec, cfg: JobConfig, checkpoint: str) -> None:
    """A checkpoint's weights into ``build_model``'s model. A LoRA run's step checkpoints leave its frozen base out
    (they hold what it trains: the adapters, and buffers such as a MoE's routing bias): the base then comes from
    the config's checkpoint.initial_load_path (or its seeded initialisation), and is checked against the base
    fingerprint the checkpoint keeps (components/checkpointing/frozen_base.py)."""
    frozen = frozen_names([model])
    if frozen and not _is_hf(checkpoint):
        saved = verify_checkpoint(checkpoint).state_dict_metadata
        # Told by the frozen weights themselves: a checkpoint holding none of them is a step checkpoint of such a
        # run; a full one (an export, a run that trained the base) holds them all.
        if not any(k.startswith("model.") and k.removeprefix("model.") in frozen for k in saved):
            base = cfg.checkpoint.initial_load_path
            if base:
                _load_weights(model, spec, base, lambda n: not is_adapter_param(n))
            load_dcp_model(model, checkpoint, lambda n: n not in frozen)  # what the checkpoint manager saves
            if any(k.startswith("base.") for k in saved):  # a base other than the run's is refused here
                load_state({"base": BaseFingerprint([model], base or "the seeded initialisation")}, checkpoint,
                           no_dist=True)
            return
    _load_weights(model, spec, checkpoint)


def load_model(config_file: str, checkpoint: str | None = None, device: str = "cpu", overrides=()) -> nn.Module:
    """An eval-mode model built from ``config_file`` with weights from ``checkpoint`` (DCP or HF folder); multi-token
    prediction blocks, which inference does not run, are left out (and their weights not read)."""
    cfg = load_model_config(config_file, overrides)
    model, spec = build_model(cfg, device, mtp=False)
    if checkpoint is not None:
        load_checkpoint(model, spec, cfg, checkpoint)
    return model.eval()
