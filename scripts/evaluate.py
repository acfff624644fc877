"""Perplexity of a checkpoint on a dataset (default: the config's validation split).

    python scripts/evaluate.py --config outputs/config.toml --checkpoint outputs/checkpoint/step-100
    python scripts/evaluate.py --config X.toml --checkpoint hf_folder --validation.dataset_path held_out.jsonl

The number is computed by the trainer's Validator with the config's precision, so it equals
exp(val_loss) the training run logged for the same step and data. Any trainer flag of the
[validation] (or other) sections may follow as an override: --validation.seq_len 512,
--validation.steps 20, --validation.local_batch_size 4 ...
"""

import argparse
import json
import sys
from pathlib import Path

from torchtitan.components.checkpoint import CheckpointError
from torchtitan.config import ConfigError
from torchtitan.data import DataError
from torchtitan.device_arg import default_device, parse_device
from torchtitan.evaluation import evaluate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Unrecognised --section.field flags are passed on as config overrides.")
    parser.add_argument("--config", required=True,
                        help="the TOML the checkpoint was trained with "
                             "(a run's resolved {dump_folder}/config.toml is best)")
    parser.add_argument("--checkpoint", help="DCP step folder or Hugging Face folder (default: untrained weights)")
    parser.add_argument("--device", default=default_device(),
                        help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args, overrides = parser.parse_known_args(argv)
    bad = [flag for flag in overrides if flag.startswith("-") and not flag.startswith("--") or flag == "--"]
    if bad:
        print(f"error: unknown argument {bad[0]}; overrides look like --section.field value", file=sys.stderr)
        return 2
    try:
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a folder; give a DCP step folder or HF folder")
        device = parse_device(args.device)
        result = evaluate(args.config, args.checkpoint, overrides=overrides, device=device)
    except (ConfigError, CheckpointError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss: {result['val_loss']:.6f}  perplexity: {result['val_perplexity']:.4f}  "
              f"tokens: {result['val_tokens']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
