"""Convert a torchtitan checkpoint (DCP step folder or model export) to a Hugging Face model folder.

    python scripts/convert_to_hf.py outputs/checkpoint/step-100 hf_out --config train_configs/debug_model.toml

Writes config.json, generation_config.json, the tokenizer files and model.safetensors, loadable with
transformers' AutoModelForCausalLM / LlamaForCausalLM.from_pretrained and AutoTokenizer.
"""

import argparse
import sys
from pathlib import Path

from torchtitan.components.checkpoint import CheckpointError
from torchtitan.components.hf_checkpoint import write_hf_folder
from torchtitan.config import ConfigError, load_config
from torchtitan.hardware import DTYPES
from torchtitan.inference import build_model, load_dcp_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="DCP step folder (e.g. outputs/checkpoint/step-100)")
    parser.add_argument("output", type=Path, help="folder to write the Hugging Face model to")
    parser.add_argument("--config", required=True, help="the TOML the checkpoint was trained with")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights dtype (default: the config's checkpoint.export_dtype)")
    parser.add_argument("--drop_expert_bias", action="store_true",
                        help="a MoE whose Hugging Face format has no routing bias: drop the trained bias (the "
                             "largest value dropped is logged) instead of refusing (default: the config's "
                             "checkpoint.hf_drop_expert_bias)")
    parser.add_argument("--include_mtp", action="store_true",
                        help="also write the multi-token prediction blocks (default: the config's "
                             "checkpoint.hf_include_mtp)")
    args = parser.parse_args(argv)
    try:
        cfg, _ = load_config(["--job.config_file", args.config])
        include_mtp = args.include_mtp or cfg.checkpoint.hf_include_mtp
        # Without MTP in the export its blocks are not read either (a checkpoint saved without them converts).
        model, spec = build_model(cfg, mtp=include_mtp)
        load_dcp_model(model, args.checkpoint)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if spec.state_dict_adapter is None:
        print(f"error: model '{cfg.model.name}' has no Hugging Face state-dict adapter", file=sys.stderr)
        return 2
    dtype_name = args.dtype or cfg.checkpoint.export_dtype
    tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
    adapter = spec.state_dict_adapter(model.args)
    adapter.drop_expert_bias = args.drop_expert_bias or cfg.checkpoint.hf_drop_expert_bias
    if include_mtp:
        if not model.args.mtp_depth:
            print(f"error: --include_mtp: the model of {args.config} has no multi-token prediction blocks "
                  "(model.mtp_depth)", file=sys.stderr)
            return 2
        adapter.include_mtp = True
    try:
        count = write_hf_folder(args.output, model.state_dict(), adapter, tokenizer, cfg.model.hf_assets_path,
                                dtype_name)
    except ValueError as e:  # a model the format cannot express (e.g. a trained routing bias)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {count} tensors ({dtype_name}) and config to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
