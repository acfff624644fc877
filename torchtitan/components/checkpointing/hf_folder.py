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

from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.hardware import DTYPES
from torchtitan.log import one_line
from torchtitan.models.shared.decoder_state_dict_adapter import RefusedWeightError, UnexpectedWeightError
from torchtitan.models.shared.hf_config import describe, read_config_json

# Copied from model.hf_assets_path when present, so that AutoTokenizer loads the folder too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WEIGHTS_FILE = "model.safetensors"


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors files")
    return files


def read_headers(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor's name -> (its file, its shape), from the safetensors headers alone: no tensor is read."""
    headers: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        except Exception as e:  # safetensors' own error type is not importable under a stable name
            raise CheckpointError(f"{file} is not a complete safetensors file ({one_line(e)}); replace it") from None
        for key, shape in shapes.items():
            if key in headers:
                raise CheckpointError(f"{file}: tensor {key} is also in {headers[key][0]}; a tensor belongs in one "
                                      "file")
            headers[key] = file, shape
    return headers


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in ``folder``, under its Hugging Face name (``read_safetensors_file``
    on each)."""
    state = {}
    for file in _files(folder):
        state.update(read_safetensors_file(file))
    return state


def read_safetensors_file(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a tensor holding NaN or inf is refused, naming the file and the tensor
    (such weights would only show up later as a non-finite loss), as is a file that is not complete safetensors."""
    state = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    except Exception as e:  # safetensors' own error type is not importable under a stable name
        raise CheckpointError(f"{file} is not a complete safetensors file ({one_line(e)}); replace it") from None
    for key, tensor in state.items():
        if tensor.is_floating_point():
            finite = torch.isfinite(tensor if tensor.element_size() > 1 else tensor.float())
            if not finite.all():
                raise CheckpointError(f"{file}: tensor {key} holds {int((~finite).sum())} non-finite values "
                                      f"(NaN or inf) of its {tensor.numel()}; these weights cannot be trained "
                                      "or run: repair or replace the file")
    return state


def check_hf_config(folder: Path, adapter) -> None:
    """Refuse a folder whose config.json computes otherwise than the model its weights are loaded into (a sliding
    window, a rotary share, a YaRN factor, a rope theta of its own ...: weights of the right shapes that would give
    other logits), naming every key that differs with both values (models/shared/hf_config.py says which keys and
    how a file leaving one out reads). A folder without config.json, or an adapter without config.json support (a
    custom family's), is not judged here."""
    file = Path(folder) / "config.json"
    differences = getattr(adapter, "hf_config_differences", None)
    if differences is None or not file.is_file():
        return
    try:
        config = read_config_json(file)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    theirs = config.get("model_type")
    if theirs is not None and theirs != adapter.hf_model_type:
        raise CheckpointError(f"{file} has model_type {theirs!r}, but this model ({adapter.family}) reads "
                              f"{adapter.hf_model_type!r}: the weights are of another model family (check model.name)")
    try:
        found = differences(config)
    except ValueError as e:  # the model has no Hugging Face form at all
        raise CheckpointError(f"cannot judge {file} against this model: {one_line(e)}") from None
    if found:
        raise CheckpointError(f"{file} describes another model than model.flavor's ({adapter.family}): "
                              f"{describe(found, 'model.flavor has')}; set model.flavor to these weights' size, or "
                              f"to \"hf:{folder}\" to build the model from this config.json")


def check_hf_folder(folder: Path, adapter, expected: dict[str, torch.Size]) -> None:
    """Check a Hugging Face folder against the model: its config.json first (``check_hf_config``), then its tensor
    names and shapes (from the headers, before any tensor is read) against the model's weights ``expected`` (our
    name -> shape; with pipeline parallelism, the local stages' only). Raises CheckpointError naming the file and
    the key or tensor."""
    check_hf_config(folder, adapter)
    headers = read_headers(folder)
    model = f"this model ({adapter.family}, {adapter.hf_architecture})"
    # A format the adapter cannot read at all (quantised weights) comes first: its tensors also lack their
    # unquantised names, which the checks below would report as missing.
    if (check_names := getattr(adapter, "check_hf_names", None)) is not None:
        try:
            check_names(headers)
        except RefusedWeightError as e:
            raise CheckpointError(f"{headers[e.name][0]}: {e}") from None
    # The model's weights under Hugging Face names and layouts: each present one must have its shape.
    try:
        needed = {name: tuple(t.shape) for name, t in adapter.to_hf(
            {name: torch.empty(shape, device="meta") for name, shape in expected.items()}).items()}
    except (KeyError, ValueError):
        needed = {}  # a weight without a Hugging Face name: judged under our names below
    for name, shape in needed.items():
        if name in headers and headers[name][1] != shape:
            raise CheckpointError(f"{headers[name][0]}: tensor {name} has shape {list(headers[name][1])}, but "
                                  f"{model} needs {list(shape)}: the weights are of another size (check "
                                  "model.flavor)")
    absent = [name for name in needed if name not in headers]
    try:
        ours = adapter.from_hf({name: torch.empty(shape, device="meta") for name, (_, shape) in headers.items()})
    except UnexpectedWeightError as e:
        raise CheckpointError(f"{headers[e.name][0]}: unexpected Hugging Face weight {e.name} for {model}: the "
                              "weights are of another model family (check model.name)") from None
    except (KeyError, ValueError, RuntimeError) as e:
        if absent:
            ours = {}  # named below
        else:
            raise CheckpointError(f"{folder} does not fit {model}: {one_line(e)}") from None
    missing = [name for name in expected if name not in ours]
    wrong = [name for name in expected if name in ours and tuple(ours[name].shape) != tuple(expected[name])]
    if not (missing or wrong):
        return
    if absent:  # the Hugging Face names are the ones the user can look for in the files
        missing = absent
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder} is missing tensor {missing[0]}{more} that {model} has: the weights are of "
                              "a model built differently (check model.flavor, and model.mtp_depth: multi-token "
                              "prediction blocks are layers.{n_layers}...)")
    raise CheckpointError(f"{folder}: {wrong[0]} comes out with shape {list(ours[wrong[0]].shape)}, but {model} needs "
                          f"{list(expected[wrong[0]])} (check model.flavor)")


def read_hf_model_state(folder: Path, adapter, expected: dict[str, torch.Size] | None = None
                        ) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face folder under our names and layouts (``adapter``: the family's
    state-dict adapter), full tensors on CPU. With ``expected`` (our name -> shape) the folder is checked against
    it first (``check_hf_folder``)."""
    if expected is not None:
        check_hf_folder(folder, adapter, expected)
    try:
        return adapter.from_hf(read_safetensors(folder))
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"cannot read Hugging Face weights in {folder}: {one_line(e)}") from None


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
