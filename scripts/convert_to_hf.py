"""Convert a torchtitan checkpoint (DCP step folder or model export) to a Hugging Face model folder.

    python scripts/convert_to_hf.py outputs/checkpoint/step-100 hf_out --config train_configs/debug_model.toml

Writes config.json, generation_config.json, the tokenizer files and model.safetensors, loadable with
transformers' AutoModelForCausalLM / LlamaForCausalLM.from_pretrained and AutoTokenizer.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchtitan.components.checkpoint import CheckpointError
from torchtitan.config import ConfigError, load_config
from torchtitan.inference import build_model, load_dcp_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="DCP step folder (e.g. outputs/checkpoint/step-100)")
    parser.add_argument("output", type=Path, help="folder to write the Hugging Face model to")
    parser.add_argument("--config", required=True, help="the TOML the checkpoint was trained with")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the config's checkpoint.export_dtype)")
    args = parser.parse_args()
    try:
        cfg, _ = load_config(["--job.config_file", args.config])
        model, spec = build_model(cfg)
        load_dcp_model(model, args.checkpoint)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if spec.state_dict_adapter is None:
        print(f"error: model '{cfg.model.name}' has no Hugging Face state-dict adapter", file=sys.stderr)
        return 2
    dtype_name = args.dtype or cfg.checkpoint.export_dtype
    adapter = spec.state_dict_adapter(model.args)
    state = adapter.to_hf({k: v.detach().to(DTYPES[dtype_name]).contiguous() for k, v in model.state_dict().items()})

    tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
    args.output.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.output / "model.safetensors"), metadata={"format": "pt"})
    config = adapter.hf_config(tokenizer.bos_id, tokenizer.eos_id, dtype_name)
    (args.output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    (args.output / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        source = Path(cfg.model.hf_assets_path) / name
        if source.is_file():
            shutil.copy(source, args.output / name)
    print(f"wrote {len(state)} tensors ({dtype_name}) and config to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
