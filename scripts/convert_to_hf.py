"""Convert a torchtitan checkpoint (DCP step folder or model export) to a Hugging Face model folder.

    python scripts/convert_to_hf.py outputs/checkpoint/step-100 hf_out --config train_configs/debug_model.toml

Writes config.json, generation_config.json, the tokenizer files and model.safetensors, loadable with
transformers' AutoModelForCausalLM / LlamaForCausalLM.from_pretrained and AutoTokenizer.

A LoRA run's checkpoint (its base from the config's checkpoint.initial_load_path) converts with
``--merge_lora`` (the adapters folded into the base: a plain model folder) or ``--lora_adapter`` (a PEFT
adapter folder, adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained on top of
the base's Hugging Face folder).

A model imported at a Hugging Face checkpoint's own dimensions (``--model.flavor hf:<folder>``; other
--section.field flags are config overrides too) converts back with the same flavor: config.json is written from the
model, so it equals the imported one on every key that changes the computation.

The output folder must be new or empty; it is written whole or not at all (torchtitan/output_folder.py).
"""

import sys
from pathlib import Path

from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.components.lora.peft_adapter import write_peft_adapter
from torchtitan.config import ConfigError
from torchtitan.config_check import load_model_config
from torchtitan.hardware import DTYPES
from torchtitan.inference import build_model, load_checkpoint
from torchtitan.models.shared.lora import adapter_settings, is_adapted, merge_adapters
from torchtitan.output_folder import OutputError, folder_problem, written_whole
from torchtitan.script_args import ScriptParser


def _trained_beyond_adapters(cfg, model) -> str | None:
    """What a LoRA run trains besides its adapters, in words; None if nothing."""
    if cfg.lora.train_base:
        return "the base weights too (lora.train_base)"
    if cfg.moe.bias_update_rate > 0 and any(name.endswith(".moe.expert_bias") for name in model.state_dict()):
        return "the MoE routing bias too (moe.bias_update_rate > 0)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0],
                          epilog="Unrecognised --section.field flags are passed on as config overrides.")
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
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--merge_lora", action="store_true",
                      help="a LoRA checkpoint: fold the adapters into the base weights and write the whole model")
    lora.add_argument("--lora_adapter", action="store_true",
                      help="a LoRA checkpoint: write its adapters as a PEFT adapter folder")
    args, overrides = parser.parse_known_args(argv)
    if problem := folder_problem(args.output):  # before the checkpoint is read: nothing of the user's is touched
        print(f"error: output {args.output} {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_model_config(args.config, overrides)
        include_mtp = args.include_mtp or cfg.checkpoint.hf_include_mtp
        # Without MTP in the export its blocks are not read either (a checkpoint saved without them converts).
        model, spec = build_model(cfg, mtp=include_mtp)
        load_checkpoint(model, spec, cfg, str(args.checkpoint))
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    adapted = any(is_adapted(m) for m in model.modules())
    if adapted == (not (args.merge_lora or args.lora_adapter)):
        print(f"error: {args.config} trains LoRA adapters: pass --merge_lora (the whole model) or --lora_adapter (a "
              "PEFT adapter folder)" if adapted else f"error: --merge_lora/--lora_adapter: {args.config} trains no "
              "LoRA adapters (model.converters)", file=sys.stderr)
        return 2
    if args.lora_adapter and (trained := _trained_beyond_adapters(cfg, model)):
        print(f"error: --lora_adapter: {args.config} trains {trained}, which a PEFT adapter folder cannot carry (the "
              "adapters on the base would be another model); pass --merge_lora for the whole model", file=sys.stderr)
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
    state = model.state_dict()
    try:
        with written_whole(args.output) as folder:
            if args.lora_adapter:
                count = write_peft_adapter(folder, state, adapter, adapter_settings(model), dtype_name,
                                           base_model=cfg.checkpoint.initial_load_path or "")
            else:
                if args.merge_lora:
                    state = merge_adapters(state, adapter_settings(model))
                count = write_hf_folder(folder, state, adapter, tokenizer, cfg.model.hf_assets_path, dtype_name)
    except (ValueError, OutputError) as e:  # ValueError: a model the format cannot express (a trained routing bias)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.lora_adapter:
        print(f"wrote a PEFT adapter of {count} tensors ({dtype_name}) to {args.output}")
        return 0
    print(f"wrote {count} tensors ({dtype_name}) and config to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
