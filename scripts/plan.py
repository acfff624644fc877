"""Predict per-device memory and step time of a training config on a given device.

    python scripts/plan.py --config train_configs/llama3_8b.toml --device H100 --world_size 8
    python scripts/plan.py --config train_configs/debug_model.toml --device CPU --training.local_batch_size 4

Prints a table of parameters, gradients, optimizer state, activations and transient buffers per
device, the predicted step time, the generation engine's cache for a batch (--generate_batch rows of
--generate_length tokens; default the config's local batch and seq_len), and whether training fits.
Trainer flags (--section.field value) after the options override the config, as for the trainer.
The config is checked as the trainer checks it first. On CPU the step time is measured by training
the model cut to one and two blocks, which is skipped when the run does not fit the machine or a
block is large (over 200M parameters), or when --efficiency is given.

Exit codes:
  0  plan made: the run fits the device's memory
  3  plan made: the run does not fit (the last line says DOES NOT FIT and by how much)
  2  the config or command line cannot be planned: one line `error: ...` on stderr naming the
     field and its value (an unknown flavor, degrees that do not multiply to --world_size, ...)
  1  the planner itself failed on a config it accepted (a bug): one line `error: ...` on stderr
Usage errors (no --config, an unknown --device, a number out of range) are one line `error: ...`, exit 2.
"""

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from torchtitan.config import ConfigError, ConfigSources, JobConfig, load_config
from torchtitan.config_check import import_custom_modules, validate_config
from torchtitan.planner import DEVICE_MEMORY_GIB, PlanError, format_plan, layout_problem, plan, smallest_world_size
from torchtitan.protocols.train_spec import TOKENIZER_FILES, flavor_args, get_train_spec
from torchtitan.script_args import ScriptParser, integer, real

DEVICES = [*DEVICE_MEMORY_GIB, "CPU"]
FITS, PLANNER_BUG, CANNOT_PLAN, DOES_NOT_FIT = 0, 1, 2, 3
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"


def validate(cfg: JobConfig, sources: ConfigSources, world_size: int, vocab_size: int | None) -> None:
    """The trainer's own config checks, so a plan is only made for a config that would start.

    Planning needs the tokenizer only for its vocabulary size. When the flavor fixes it (or
    --vocab_size gives it) and the tokenizer has not been downloaded yet, the checks run against the
    repository's bundled tokenizer instead, so a plan can be made before the download.
    """
    import_custom_modules(cfg, sources)
    folder = Path(cfg.model.hf_assets_path)
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    try:
        flavor_vocab = flavor_args(get_train_spec(cfg.model.name), cfg.model).vocab_size
    except (KeyError, ConfigError):
        flavor_vocab = None  # validate_config names the unknown model or flavor
    if not has_tokenizer and (flavor_vocab or vocab_size) and BUNDLED_TOKENIZER.is_dir():
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_assets_path=str(BUNDLED_TOKENIZER)))
    validate_config(cfg, sources, world_size)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Unrecognised --section.field flags are passed on as config overrides.")
    parser.add_argument("--config", required=True, help="training TOML")
    parser.add_argument("--device", required=True, type=str.upper, choices=DEVICES, help="device kind")
    parser.add_argument("--world_size", type=integer(1),
                        help="devices in the run (default 1); the config's parallel degrees must multiply to it")
    parser.add_argument("--efficiency", type=real(0, 1, low_open=True),
                        help="fraction of peak FLOP/s reached (default 0.40 on GPUs; "
                             "on CPU the kernels are timed instead)")
    parser.add_argument("--vocab_size", type=integer(1),
                        help="vocabulary size, for flavors that take it from a tokenizer you do not have locally")
    parser.add_argument("--generate_batch", type=integer(1),
                        help="rows the generation cache line is sized for (default training.local_batch_size)")
    parser.add_argument("--generate_length", type=integer(1),
                        help="tokens per row for the generation cache line: the longest prompt plus the most new "
                             "tokens (default training.seq_len)")
    args, overrides = parser.parse_known_args(argv)
    world_size, cfg = args.world_size or 1, None
    try:
        cfg, sources = load_config(["--job.config_file", args.config, *overrides])
        validate(cfg, sources, world_size, args.vocab_size)
        result = plan(cfg, args.device, world_size, args.efficiency, args.vocab_size,
                      generate_batch=args.generate_batch, generate_length=args.generate_length)
    except (ConfigError, PlanError) as e:
        return error(str(e) + world_size_hint(cfg, args.config, args.world_size), CANNOT_PLAN)
    except Exception as e:  # a config that passed the checks must still never end in a traceback
        return error(f"the planner failed on this config (a bug; please report it with the command line): "
                     f"{type(e).__name__}: {e}", PLANNER_BUG)
    print(f"{cfg.model.name}/{cfg.model.flavor}: local batch {cfg.training.local_batch_size} x seq "
          f"{cfg.training.seq_len}, activation checkpointing {cfg.activation_checkpoint.mode}")
    print(format_plan(result))
    return FITS if result.fits else DOES_NOT_FIT


def world_size_hint(cfg: JobConfig | None, config_path: str, given: int | None) -> str:
    """When the degrees do not lay out on the world size planned for, the sentence that says which world size
    that was, how to set it, and the smallest the degrees allow (and the one the preset's header names)."""
    world_size = given or 1
    if cfg is None or layout_problem(cfg.parallelism, world_size) is None:
        return ""
    assumed = f"--world_size {given}" if given else "a world size of 1 (the default; --world_size sets it)"
    smallest = smallest_world_size(cfg.parallelism)
    allowed = (f"the smallest these parallel degrees allow is {smallest} (--world_size {smallest})" if smallest
               else "no world size fits these parallel degrees")
    written_for = header_gpus(Path(config_path))
    header = f"; the config's header says it is written for {written_for} GPUs" if written_for else ""
    return f". This plan assumed {assumed}; {allowed}{header}"


def header_gpus(path: Path) -> int | None:
    """N from "on N GPUs" in the config file's opening comment (how the multi-GPU presets say what they are
    written for), or None."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    opening = []
    for line in lines:
        if not line.startswith("#"):
            break
        opening.append(line)
    found = re.search(r"\bon (\d+) GPUs\b", " ".join(opening))
    return int(found.group(1)) if found else None


def error(message: str, code: int) -> int:
    """Print ``message`` as the one line ``error: ...`` on stderr; return the exit code."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
