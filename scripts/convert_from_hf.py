"""Convert a Hugging Face model folder (config.json + safetensors) to a torchtitan model checkpoint.

    python scripts/convert_from_hf.py hf_model outputs/seed --config train_configs/llama3_8b.toml
    python scripts/convert_from_hf.py hf_model outputs/seed --config train_configs/qwen3_debug.toml \
        --model.flavor hf:hf_model

The config's model.name and model.flavor say which model the weights go into; a config.json that computes
otherwise than that flavor (another width, rope theta, sliding window, ...) is refused naming each key. With
``model.flavor = "hf:<folder>"`` the model is built at the folder's own dimensions instead. Other --section.field
flags are config overrides too.

The output is a DCP folder holding the model weights; start training from it with
--checkpoint.initial_load_path outputs/seed (or load it with torchtitan.load_model). The output folder must be new
or empty; it is written whole or not at all (torchtitan/output_folder.py).
"""

import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.components.checkpointing.hf_folder import is_hf_folder
from torchtitan.components.checkpointing.states import ModelState
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.inference import build_model, load_hf_weights
from torchtitan.output_folder import OutputError, folder_problem, written_whole
from torchtitan.script_args import ScriptParser


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0],
                          epilog="Unrecognised --section.field flags are passed on as config overrides.")
    parser.add_argument("hf_folder", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--config", required=True, help="a TOML whose model.flavor matches the HF model (or is "
                                                        "\"hf:<the folder>\": built from its config.json)")
    args, overrides = parser.parse_known_args(argv)
    if problem := folder_problem(args.output):  # before anything is read: nothing of the user's is touched
        print(f"error: output {args.output} {problem}", file=sys.stderr)
        return 2
    if not is_hf_folder(args.hf_folder):
        print(f"error: {args.hf_folder} has no config.json and *.safetensors", file=sys.stderr)
        return 2
    try:
        cfg = load_model_config(args.config, overrides)
        model, spec = build_model(cfg)
        load_hf_weights(model, spec, args.hf_folder)
    except (ConfigError, CheckpointError, ValueError) as e:  # ValueError: a model HF cannot express
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with written_whole(args.output) as folder:
            dcp.save({"model": ModelState([model])}, checkpoint_id=str(folder), no_dist=True)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a torchtitan model checkpoint to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
