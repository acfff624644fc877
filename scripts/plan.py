"""Predict per-device memory and step time of a training config on a given device.

    python scripts/plan.py --config train_configs/llama3_8b.toml --device H100 --world_size 8
    python scripts/plan.py --config train_configs/debug_model.toml --device CPU --training.local_batch_size 4

Prints a table of parameters, gradients, optimizer state, activations and transient buffers per
device, the predicted step time, and whether it fits (exit code 3 when it does not). Trainer flags
(--section.field value) after the options override the config, as for the trainer.
"""

import argparse
import sys

from torchtitan.config import ConfigError, load_config
from torchtitan.planner import DEVICE_MEMORY_GIB, PlanError, format_plan, plan

DEVICES = [*DEVICE_MEMORY_GIB, "CPU"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Unrecognised --section.field flags are passed on as config overrides.")
    parser.add_argument("--config", required=True, help="training TOML")
    parser.add_argument("--device", required=True, type=str.upper, choices=DEVICES, help="device kind")
    parser.add_argument("--world_size", type=int, default=1,
                        help="devices in the run (default 1); the config's parallel degrees must multiply to it")
    parser.add_argument("--efficiency", type=float,
                        help="fraction of peak FLOP/s reached (default 0.40 on GPUs; on CPU the kernels are timed instead)")
    parser.add_argument("--vocab_size", type=int,
                        help="vocabulary size, for flavors that take it from a tokenizer you do not have locally")
    args, overrides = parser.parse_known_args(argv)
    if args.world_size < 1:
        print(f"error: --world_size {args.world_size} is invalid; it must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg, _ = load_config(["--job.config_file", args.config, *overrides])
        result = plan(cfg, args.device, args.world_size, args.efficiency, args.vocab_size)
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.model.name}/{cfg.model.flavor}: local batch {cfg.training.local_batch_size} x seq "
          f"{cfg.training.seq_len}, activation checkpointing {cfg.activation_checkpoint.mode}")
    print(format_plan(result))
    return 0 if result.fits else 3


if __name__ == "__main__":
    sys.exit(main())
