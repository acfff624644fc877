"""Hugging Face model folders (config.json + safetensors): the one place that reads and writes them.

A folder written here loads with transformers' ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``, and back into torchtitan with ``torchtitan.load_model`` or
``--checkpoint.initial_load_path ... --checkpoint.initial_load_in_hf``. Writers:
``scripts/convert_to_hf.py`` and the trainer's last-step export (``checkpoint.last_save_in_hf``).
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torchtitan.distributed.precision import DTYPES

# Copied from model.hf_assets_path when present, so that AutoTokenizer loads the folder too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WEIGHTS_FILE = "model.safetensors"


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in ``folder``, under its Hugging Face name."""
    state = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def read_hf_model_state(folder: Path, adapter) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face folder under our names and layouts (``adapter``: the family's
    state-dict adapter), full tensors on CPU."""
    return adapter.from_hf(read_safetensors(folder))


def write_hf_folder(folder: Path, state: dict[str, torch.Tensor], adapter, tokenizer, hf_assets_path: str,
                    dtype: str) -> int:
    """Write our full (unsharded) model state dict as a Hugging Face folder; returns the tensors written.

    ``adapter`` is the family's state-dict adapter (renames to Hugging Face and writes its config.json),
    ``tokenizer`` gives the bos/eos ids, ``hf_assets_path`` the tokenizer files to copy, and ``dtype``
    ("float32", "bfloat16", "float16") the weights' dtype.
    """
    torch_dtype = DTYPES[dtype]
    ours = {k: v.detach().to("cpu", torch_dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in state.items()}
    hf_state = adapter.to_hf(ours)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf_state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter.hf_config(tokenizer.bos_id, tokenizer.eos_id, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        source = Path(hf_assets_path) / name
        if source.is_file():
            shutil.copy(source, folder / name)
    return len(hf_state)
