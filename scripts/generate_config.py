"""Write a training TOML sized for a model, a cluster and a token budget.

    python scripts/generate_config.py --flavor 1.1B --nodes 2 --gpus_per_node 8 --global_batch_size 512 \
        --seq_len 2048 --output train_configs/llama3_1b_2x8.toml [--dry-run]

Rules (docs/planning.md):
  tokens         default 22 x non-embedding parameters (Chinchilla-style compute-optimal budget)
  steps          ceil(tokens / (global_batch_size x seq_len))
  warmup_steps   2% of the steps, at least 1
  parallelism    FSDP over all ranks; if the planner says the model does not fit the device, tensor
                 parallelism within a node (2, 4, ... dividing gpus_per_node) until it does; degrees the
                 config validation rejects (e.g. not dividing the heads) are skipped;
                 --tp/--pp/--dp_shard override
  batch          local_batch_size = the largest divisor of global_batch / dp that is <= 8 (or
                 --local_batch_size), and with --pp at least the number of pipeline stages;
                 gradient accumulation makes up the rest of the global batch
The TOML is validated as the trainer validates it before it is written (exit code 2 if no valid
layout exists).
Custom dimensions (--dim --n_layers ...) instead of --flavor register a flavor named --name from a
small Python module written next to the TOML (experimental.custom_import), so the trainer can build it.
"""

import argparse
import math
import sys
import tempfile
from pathlib import Path

from torchtitan.config import ConfigError, ConfigSources, JobConfig, load_config
from torchtitan.config.loading import config_to_toml
from torchtitan.config_check import import_custom_modules, validate_config
from torchtitan.distributed.pipeline_parallel import count_stages
from torchtitan.models.llama3.args import Llama3ModelArgs, llama3_flavors
from torchtitan.planner import DEVICE_MEMORY_GIB, GPU_EFFICIENCY, PlanError, model_shape, plan
from torchtitan.script_args import ScriptParser, integer, real

TOKENS_PER_PARAM = 22
WARMUP_FRACTION = 0.02
MAX_LOCAL_BATCH = 8
BASE_CONFIG = "train_configs/debug_model.toml"
CUSTOM_DIMS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim_multiplier", "multiple_of")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model (a registered flavor, or custom dimensions)")
    model.add_argument("--flavor", help=f"registered llama3 flavor: {', '.join(llama3_flavors)}")
    model.add_argument("--name", default="custom", help="flavor name for custom dimensions (default: custom)")
    for dim in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of"):
        model.add_argument(f"--{dim}", type=integer(1), help=f"custom model: {dim}")
    model.add_argument("--ffn_dim_multiplier", type=real(0, low_open=True), help="custom model: ffn_dim_multiplier")
    model.add_argument("--hf_assets_path", default="assets/tokenizer",
                       help="tokenizer folder (default: assets/tokenizer)")
    cluster = parser.add_argument_group("cluster and batch")
    cluster.add_argument("--nodes", type=integer(1), default=1, help="nodes (default 1)")
    cluster.add_argument("--gpus_per_node", type=integer(1), default=8, help="devices per node (default 8)")
    cluster.add_argument("--device", type=str.upper, default="H100", choices=[*DEVICE_MEMORY_GIB, "CPU"],
                         help="device kind, for the fit check that decides tensor parallelism (default H100)")
    cluster.add_argument("--global_batch_size", type=integer(1), required=True, help="sequences per optimizer step")
    cluster.add_argument("--seq_len", type=integer(1), default=2048, help="tokens per sequence (default 2048)")
    cluster.add_argument("--local_batch_size", type=integer(1), help=f"sequences per micro-batch per rank "
                         f"(default: the largest divisor of global_batch / dp that is <= {MAX_LOCAL_BATCH})")
    cluster.add_argument("--tokens", type=real(0, low_open=True),
                         help=f"training tokens (default {TOKENS_PER_PARAM} x non-embedding parameters)")
    cluster.add_argument("--tp", type=integer(1), help="tensor-parallel degree (default: 1, or the least that fits)")
    cluster.add_argument("--pp", type=integer(1), default=1, help="pipeline-parallel degree (default 1)")
    cluster.add_argument("--dp_shard", type=integer(1), help="FSDP degree (default: all ranks left over)")
    cluster.add_argument("--activation_checkpoint", choices=["none", "selective", "full"], default="selective",
                         help="activation checkpointing mode (default: selective, every 2nd block)")
    out = parser.add_argument_group("output")
    out.add_argument("--base", default=BASE_CONFIG, help=f"TOML whose other settings are kept (default {BASE_CONFIG})")
    out.add_argument("--output", type=Path, required=True, help="TOML file to write")
    out.add_argument("--dry-run", action="store_true", help="print the TOML path and the sbatch command; write nothing")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad flag."""
    custom = {d: getattr(args, d) for d in CUSTOM_DIMS if getattr(args, d) is not None}
    if (args.flavor is None) == (not custom):
        raise ValueError("give either --flavor or custom dimensions (--dim --n_layers --n_heads ...), "
                         "not both or neither")
    if args.flavor is not None and args.flavor not in llama3_flavors:
        raise ValueError(f"--flavor {args.flavor} is not registered; valid: {', '.join(llama3_flavors)}")
    if custom and not all(d in custom for d in ("dim", "n_layers", "n_heads")):
        raise ValueError("custom dimensions need at least --dim, --n_layers and --n_heads")
    if custom and not args.name.isidentifier():
        raise ValueError(f"--name {args.name!r} is invalid; it must be a Python identifier")


def steps_for(tokens: float, global_batch_size: int, seq_len: int) -> int:
    return math.ceil(tokens / (global_batch_size * seq_len))


def warmup_for(steps: int) -> int:
    return max(1, round(WARMUP_FRACTION * steps))


def local_batch_for(per_rank: int, at_least: int = 1, multiple_of: int = 1) -> int:
    """The largest divisor of per_rank sequences that is <= MAX_LOCAL_BATCH, a multiple of
    multiple_of and >= at_least (under PP, more micro-batches than stages); if the cap leaves none, the
    smallest such divisor above it. per_rank must be >= at_least."""
    divisors = [d for d in range(at_least, per_rank + 1) if per_rank % d == 0 and d % multiple_of == 0]
    capped = [d for d in divisors if d <= MAX_LOCAL_BATCH]
    return max(capped) if capped else min(divisors)


def custom_flavor_module(args: argparse.Namespace) -> tuple[Path, str, str]:
    """(file, dotted module name, source) of the module registering the custom flavor."""
    fields = {d: getattr(args, d) for d in CUSTOM_DIMS if getattr(args, d) is not None}
    path = args.output.with_name(f"{args.output.stem}_flavor.py")
    try:
        relative = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        raise ValueError(f"--output {args.output} must be under the current folder, so the trainer (run from "
                         f"here) can import the flavor module beside it") from None
    if not all(part.isidentifier() for part in relative.with_suffix("").parts):
        raise ValueError(f"--output {args.output}: every folder and the file stem must be Python identifiers "
                         f"(the flavor module {relative} is imported by that dotted name)")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    source = (f'"""Registers the llama3 flavor {args.name!r} (written by scripts/generate_config.py)."""\n\n'
              f"from torchtitan.models.llama3.args import Llama3ModelArgs, llama3_flavors\n\n"
              f"llama3_flavors[{args.name!r}] = Llama3ModelArgs({kwargs})\n")
    return path, ".".join(relative.with_suffix("").parts), source


def build(args: argparse.Namespace) -> tuple[str, dict, str | None]:
    """(TOML text, a summary of the choices, flavor-module source or None).

    Every candidate layout is checked by the trainer's own config validation, and the chosen TOML is
    read back and validated again, so what is written is a config the trainer accepts.
    """
    world = args.nodes * args.gpus_per_node
    overrides = ["--model.hf_assets_path", args.hf_assets_path, "--training.seq_len", str(args.seq_len),
                 "--activation_checkpoint.mode", args.activation_checkpoint,
                 "--parallelism.pipeline_parallel_degree", str(args.pp)]
    module_source = None
    if args.flavor is None:
        _, module_name, module_source = custom_flavor_module(args)
        fields = {d: getattr(args, d) for d in CUSTOM_DIMS if getattr(args, d) is not None}
        # This process builds the model too; the written TOML imports the module instead.
        llama3_flavors[args.name] = Llama3ModelArgs(**fields)
        overrides += ["--model.flavor", args.name, "--experimental.custom_import", module_name]
    else:
        overrides += ["--model.flavor", args.flavor]
    cfg, _ = load_config(["--job.config_file", args.base, *overrides])
    shape = model_shape(cfg)
    non_embedding = shape.params - shape.embedding_params
    tokens = args.tokens or TOKENS_PER_PARAM * non_embedding
    steps = steps_for(tokens, args.global_batch_size, args.seq_len)
    # Under PP every stage needs a micro-batch of its own in each step: local_batch_size must give at
    # least as many micro-batches (of pipeline_parallel_microbatch_size sequences) as there are stages.
    microbatch = cfg.parallelism.pipeline_parallel_microbatch_size
    stages = count_stages(cfg.parallelism, shape.n_layers - shape.mtp_blocks) if args.pp > 1 else 1

    def layout_for(tp: int) -> tuple[int, int, int]:
        rest = world // (tp * args.pp)
        dp_shard = args.dp_shard or rest
        if world % (tp * args.pp) or rest % dp_shard:
            raise ValueError(f"tp {tp} x pp {args.pp} x dp_shard {dp_shard} cannot tile {world} ranks "
                             f"({args.nodes} nodes x {args.gpus_per_node})")
        dp = rest  # replicas x shards: every rank left over reads its own data
        if args.global_batch_size % dp:
            raise ValueError(f"--global_batch_size {args.global_batch_size} is not divisible by the "
                             f"data-parallel degree {dp}")
        per_rank = args.global_batch_size // dp
        need = stages * microbatch if args.pp > 1 else 1
        if per_rank < need:
            raise ValueError(f"--global_batch_size {args.global_batch_size} gives {per_rank} sequence(s) per "
                             f"data-parallel rank (dp {dp}), fewer than the {need} that --pp {args.pp} needs "
                             f"({stages} pipeline stages x micro-batch size {microbatch}); use --global_batch_size "
                             f">= {need * dp} or a smaller --pp")
        local = args.local_batch_size or local_batch_for(per_rank, at_least=need, multiple_of=microbatch)
        if per_rank % local:
            raise ValueError(f"--local_batch_size {local} does not divide the {per_rank} "
                             f"sequences each data-parallel rank gets per step")
        if local < need:
            raise ValueError(f"--local_batch_size {local} is invalid with --pp {args.pp}: it must be >= {need} "
                             f"({stages} pipeline stages x micro-batch size {microbatch})")
        return dp_shard, rest // dp_shard, local

    def with_layout(tp: int) -> tuple[JobConfig, ConfigSources]:
        dp_shard, replicate, local = layout_for(tp)
        flags = ["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup_for(steps)),
                 "--training.global_batch_size", str(args.global_batch_size),
                 "--training.local_batch_size", str(local),
                 "--parallelism.tensor_parallel_degree", str(tp),
                 "--parallelism.data_parallel_shard_degree", str(dp_shard),
                 "--parallelism.data_parallel_replicate_degree", str(replicate)]
        if args.pp > 1 and cfg.validation.enable:
            # Pipeline stages exchange activations of the training batch's shape.
            flags += ["--validation.local_batch_size", str(local), "--validation.seq_len", str(args.seq_len)]
        return load_config(["--job.config_file", args.base, *overrides, *flags])

    if args.tp:
        candidates = [args.tp]
    else:
        # TP stays within a node (it communicates every layer); the heads and seq_len checks are
        # left to the config validation below.
        candidates = [t for t in (1, 2, 4, 8, 16) if t <= args.gpus_per_node and args.gpus_per_node % t == 0
                      and world % (t * args.pp) == 0]
    chosen, rejected = None, []
    for tp in candidates:
        candidate, sources = with_layout(tp)
        try:
            validate_config(candidate, sources, world)
        except ConfigError as e:
            rejected.append(f"tp {tp}: {e}")
            continue
        # Only the memory is used: a fixed efficiency skips the CPU step-time calibration.
        chosen = candidate, plan(candidate, args.device, world, efficiency=GPU_EFFICIENCY)
        if chosen[1].fits:
            break
    if chosen is None:
        reasons = "; ".join(rejected) or "no tensor-parallel degree divides them"
        raise ValueError(f"no valid layout for {world} ranks: {reasons}")
    cfg, prediction = chosen
    text = config_to_toml(cfg)
    validate_text(text, world)
    dp = world // (cfg.parallelism.tensor_parallel_degree * args.pp)
    summary = {"world_size": world, "non_embedding_params": non_embedding, "tokens": tokens, "steps": steps,
               "warmup_steps": cfg.lr_scheduler.warmup_steps, "tp": cfg.parallelism.tensor_parallel_degree,
               "pp": args.pp, "dp_shard": cfg.parallelism.data_parallel_shard_degree,
               "local_batch_size": cfg.training.local_batch_size,
               "grad_accumulation": args.global_batch_size // (cfg.training.local_batch_size * dp),
               "predicted_gib": prediction.memory.total / 2**30, "fits": prediction.fits}
    header = (f"# Generated by scripts/generate_config.py: {args.nodes} node(s) x {args.gpus_per_node} "
              f"{args.device}, {tokens:.3g} tokens, global batch {args.global_batch_size} x {args.seq_len}.\n"
              f"# Predicted {summary['predicted_gib']:.1f} GiB per device "
              f"({'fits' if prediction.fits else 'DOES NOT FIT'}; scripts/plan.py shows the breakdown).\n\n")
    return header + text, summary, module_source


def validate_text(text: str, world: int) -> None:
    """Read the TOML text back as the trainer will and validate it (ConfigError if it is not valid)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "generated.toml"
        path.write_text(text)
        cfg, sources = load_config(["--job.config_file", str(path)])
        validate_config(cfg, sources, world)


def check_flavor_module(path: Path, world: int) -> None:
    """Import the written flavor module the way the trainer will (from the launch folder) and validate."""
    cfg, sources = load_config(["--job.config_file", str(path)])
    sys.path.insert(0, str(Path.cwd()))  # `python -m torchtitan.train` puts the launch folder first
    try:
        import_custom_modules(cfg, sources)
    finally:
        sys.path.remove(str(Path.cwd()))
    validate_config(cfg, sources, world)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        text, summary, module_source = build(args)
    except (ValueError, ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    world = summary["world_size"]
    print(", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    if not summary["fits"]:
        print(f"warning: predicted {summary['predicted_gib']:.1f} GiB per device does not fit a {args.device}, "
              f"even at the largest tensor-parallel degree tried; add nodes, --pp, or a smaller model", file=sys.stderr)
    command = (f"CONFIG_FILE={args.output} NPROC_PER_NODE={args.gpus_per_node} "
               f"sbatch --nodes {args.nodes} multinode_trainer.slurm")
    if args.dry_run:
        print(f"would write {args.output}" + (" and its flavor module" if module_source else ""))
        print(f"would run: {command}")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    if module_source is not None:
        custom_flavor_module(args)[0].write_text(module_source)
        try:
            check_flavor_module(args.output, world)
        except ConfigError as e:
            print(f"error: the written {args.output} does not validate: {e}", file=sys.stderr)
            return 2
    print(f"wrote {args.output} (for {world} ranks); run: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
