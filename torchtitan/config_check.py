"""The config pre-check: a loaded JobConfig checked before anything is built, each subsystem by its own
config_problems; every failure is a one-line ConfigError. An entry point (the trainer, `python -m
torchtitan.config`, the planner and scripts call it), above every section it checks."""

import dataclasses
import importlib
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.config.loading import ConfigError, ConfigSources, load_config
from torchtitan.config_fields import changed_fields
from torchtitan.distributed.device import world_size as launched_world_size
from torchtitan.distributed.parallel_dims import ParallelDims


class _Checker:
    def __init__(self, cfg: JobConfig, sources: ConfigSources):
        self.cfg, self.sources = cfg, sources

    def value(self, key: str) -> Any:
        """The value at a dotted key; "data.sources[1]" is entry 1 of a list of tables."""
        obj = self.cfg
        for part in key.split("."):
            name, _, index = part.partition("[")
            obj = getattr(obj, name)
            if index:
                obj = obj[int(index.rstrip("]"))]
        return obj

    def fail(self, key: str, reason: str) -> None:
        where = self.sources.describe(key.split("[")[0])
        raise ConfigError(f"{where}: {key} = {self.value(key)!r} {reason}")

    def require(self, key: str, ok: bool, reason: str) -> None:
        if not ok:
            self.fail(key, reason)

    def report(self, section: str, problems: list[tuple[str, str]]) -> None:
        """Fail on the first (field, reason) a subsystem found in its own config section; with section ""
        the fields are full keys (a subsystem whose rules span sections)."""
        for field, reason in problems[:1]:
            self.fail(f"{section}.{field}" if section else field, reason)

    def positive(self, *keys: str) -> None:
        for key in keys:
            self.require(key, self.value(key) > 0, "is invalid; it must be > 0")

    def not_yet(self, key: str, enabled: bool, issue: str) -> None:
        # Better a clear refusal than a flag that silently does nothing.
        self.require(key, not enabled, f"is not supported yet ({issue}); leave it at its default")


def import_custom_modules(cfg: JobConfig, sources: ConfigSources) -> None:
    """Import experimental.custom_import (comma-separated modules) so they can register models."""
    for module in filter(None, (m.strip() for m in cfg.experimental.custom_import.split(","))):
        try:
            importlib.import_module(module)
        except Exception as e:  # any failure in user code must become the one-line error
            raise ConfigError(
                f"{sources.describe('experimental.custom_import')}: experimental.custom_import = {module!r} "
                f"failed to import: {type(e).__name__}: {e}"
            ) from None


def load_model_config(config_file: str, overrides=()) -> JobConfig:
    """The config a model is built from outside training (load_model, the converters, generate, evaluate): loaded,
    its experimental.custom_import imported (a custom family or flavor registers there, as for the trainer), and its
    [model] section and converters checked; ConfigError (one line) otherwise. The training-only sections are not
    judged (a conversion does not need the run's data)."""
    cfg, sources = load_config(["--job.config_file", str(config_file), *overrides])
    import_custom_modules(cfg, sources)
    c = _Checker(cfg, sources)
    from torchtitan.protocols.train_spec import model_config_problems

    c.report("", model_config_problems(cfg.model, cfg.training.seq_len, cfg.parallelism)[0])
    _check_converters(c)
    return cfg


def validate_config(cfg: JobConfig, sources: ConfigSources, world_size: int) -> None:
    c = _Checker(cfg, sources)
    _check_training(c)
    _check_optimizer(c)
    _check_parallelism(c, world_size)
    _check_model(c)
    _check_data(c)
    _check_converters(c)
    _check_checkpoint(c, world_size)
    _check_fault_tolerance(c)
    from torchtitan.components.evaluation.task_eval import config_problems as eval_problems

    c.report("eval", eval_problems(c.cfg.eval, c.cfg.parallelism))
    _check_rl(c, world_size)
    from torchtitan.components.observability.hang_watchdog import config_problems as hang_problems

    c.report("", hang_problems(c.cfg.observability, c.cfg.comm))
    _check_unsupported(c)


def _check_rl(c: _Checker, world_size: int) -> None:
    from torchtitan.rl.config_problems import config_problems as rl_problems

    c.report("", rl_problems(c.cfg, c.sources))
    if c.cfg.training.objective == "grpo":
        dp = ParallelDims.from_config(c.cfg.parallelism, world_size).dp
        c.require("rl.prompts_per_step", c.cfg.rl.prompts_per_step % dp == 0,
                  f"is not divisible by the data-parallel degree {dp}: each data-parallel rank takes an equal share")


def _check_training(c: _Checker) -> None:
    t = c.cfg.training
    c.positive("training.steps", "training.seq_len", "training.local_batch_size", "training.gc_freq",
               "metrics.log_freq", "profiling.profile_freq")
    loader = t.dataloader
    c.require("training.dataloader.num_workers", loader.num_workers >= 0,
              "is invalid; it must be >= 0 (0 = load in the training process)")
    c.require("training.dataloader.prefetch_factor", loader.prefetch_factor is None or
              (loader.num_workers > 0 and loader.prefetch_factor > 0),
              "is invalid; it must be unset, or > 0 with training.dataloader.num_workers > 0")
    c.require("training.dataloader.persistent_workers", not loader.persistent_workers or loader.num_workers > 0,
              "needs training.dataloader.num_workers > 0")
    c.require("training.global_batch_size", t.global_batch_size == -1 or t.global_batch_size > 0,
              "is invalid; it must be -1 (local x data-parallel degree) or > 0")
    peak = c.cfg.metrics.peak_tflops
    c.require("metrics.peak_tflops", peak is None or peak > 0, "is invalid; it must be > 0 or unset")
    c.require("training.loss_chunk_size", t.loss_chunk_size >= 0, "is invalid; it must be >= 0 (0: the plain loss)")
    c.require("training.loss_chunk_size", t.loss_chunk_size == 0 or "float8" not in c.cfg.model.converters
              or "output" in c.cfg.quantize.linear.float8.filter_fqns,
              "makes the output projection the chunked loss head, which float8 does not convert; keep 'output' in "
              "quantize.linear.float8.filter_fqns")
    from torchtitan.components.objectives.objective import config_problems as objective_problems

    c.report("training", objective_problems(t))
    from torchtitan.components.metrics.backends import config_problems as backend_problems

    c.report("", backend_problems(c.cfg.metrics))
    from torchtitan.components.observability.rank_summary import config_problems as observability_problems

    c.report("observability", observability_problems(c.cfg.observability))


def _check_optimizer(c: _Checker) -> None:
    o, s = c.cfg.optimizer, c.cfg.lr_scheduler
    c.require("optimizer.lr", o.lr >= 0, "is invalid; it must be >= 0")
    for key, beta in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        c.require(key, 0 <= beta < 1, "is invalid; it must be in [0, 1)")
    c.require("optimizer.eps", o.eps > 0, "is invalid; it must be > 0")
    c.require("optimizer.weight_decay", o.weight_decay >= 0, "is invalid; it must be >= 0")
    c.require("optimizer.muon_momentum", 0 <= o.muon_momentum < 1, "is invalid; it must be in [0, 1)")
    c.require("optimizer.muon_ns_steps", 1 <= o.muon_ns_steps < 100, "is invalid; it must be in [1, 99]")
    c.require("optimizer.state_dtype", o.state_dtype == "float32" or o.name in ("AdamW", "Muon"),
              f"is built for AdamW and Muon; with optimizer.name = {o.name!r} it must be float32 (AdamW8bit "
              "keeps its moments in its own 8 bits)")
    # A file may list every field at its default (scripts/generate_config.py writes them all): only a changed one
    # would be ignored.
    default = type(o)()
    low_bit = o.name == "AdamW8bit"
    c.require("optimizer.implementation", not (low_bit and "optimizer.implementation" in c.sources
                                              and o.implementation != default.implementation),
              f"chooses PyTorch's AdamW kernels; optimizer.name = {o.name!r} compiles torchao's own step and would "
              "ignore it (leave it out)")
    for name in ("beta1", "beta2", "eps"):
        key = f"optimizer.{name}"
        c.require(key, o.name != "SGD" or key not in c.sources or getattr(o, name) == getattr(default, name),
                  "is read by the Adam family and Muon's AdamW group; optimizer.name = 'SGD' would ignore it (leave "
                  "it out)")
    for f in (f for f in dataclasses.fields(o) if f.name.startswith("muon_")):
        key = f"optimizer.{f.name}"
        changed = key in c.sources and getattr(o, f.name) != getattr(default, f.name)
        c.require(key, o.name == "Muon" or not changed,
                  f"is read by Muon alone; optimizer.name = {o.name!r} would ignore it (set optimizer.name = 'Muon' "
                  "or leave it out)")
    c.require("lr_scheduler.warmup_steps", s.warmup_steps >= 0, "is invalid; it must be >= 0")
    c.require("lr_scheduler.decay_ratio", s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
              "is invalid; it must be in [0, 1] or unset")
    c.require("lr_scheduler.min_lr_factor", 0 <= s.min_lr_factor <= 1, "is invalid; it must be in [0, 1]")


def _check_parallelism(c: _Checker, world_size: int) -> None:
    p = c.cfg.parallelism
    degrees = {
        "parallelism.data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
        "parallelism.pipeline_parallel_degree": p.pipeline_parallel_degree,
        "parallelism.context_parallel_degree": p.context_parallel_degree,
        "parallelism.expert_parallel_degree": p.expert_parallel_degree,
    }
    for key, degree in degrees.items():
        c.require(key, degree >= 1, "is invalid; it must be >= 1")
    shard = p.data_parallel_shard_degree
    c.require("parallelism.data_parallel_shard_degree", shard == -1 or shard >= 1,
              "is invalid; it must be -1 (the remaining ranks) or >= 1")
    try:
        dims = ParallelDims.from_config(p, world_size)
    except ValueError as e:
        c.fail("parallelism.data_parallel_shard_degree", str(e))
    if reason := dims.expert_parallel_problem():
        c.fail("parallelism.expert_parallel_degree", reason)
    from torchtitan.distributed import context_parallel, tensor_parallel

    c.report("", tensor_parallel.config_problems(p, c.cfg.training, c.cfg.compile))
    c.report("", context_parallel.config_problems(p, c.cfg.training, c.cfg.validation))
    t = c.cfg.training
    if t.global_batch_size != -1:
        per_step = t.local_batch_size * dims.dp
        c.require("training.global_batch_size", t.global_batch_size % per_step == 0,
                  f"is not divisible by local_batch_size x data-parallel degree = {per_step}")


def _check_model(c: _Checker) -> None:
    from torchtitan.components.expert_load import config_problems as moe_problems
    from torchtitan.distributed.apply_common import parallelize_fn_of, pipelining_fn_of
    from torchtitan.models.shared.document_masking import config_problems as masking_problems
    from torchtitan.protocols.train_spec import model_config_problems

    problems, spec, args = model_config_problems(c.cfg.model, c.cfg.training.seq_len, c.cfg.parallelism)
    c.report("", problems)
    if spec is not None:
        c.require("model.name", parallelize_fn_of(spec) is not None,
                  "has a TrainSpec without parallelize_fn, which only a model on the shared decoder (a "
                  "models.shared.decoder.Decoder) may leave out")
        c.report("", masking_problems(c.cfg.model, c.cfg.training, spec.model_cls, c.cfg.validation))
        from torchtitan.models.shared.vision_language import config_problems as vision_problems

        c.report("", vision_problems(c.cfg.model, c.cfg.training, args, spec.build_tokenizer_fn))
    adapter = spec.state_dict_adapter
    # MoE options changed from their defaults (a saved, resolved config lists every field at its value).
    defaults = {f"moe.{f.name}": f.default for f in dataclasses.fields(c.cfg.moe)}
    defaults["checkpoint.hf_drop_expert_bias"] = False
    changed = [key for key, default in defaults.items() if c.value(key) != default]
    c.report("", moe_problems(c.cfg.moe, args, c.cfg.parallelism.expert_parallel_degree, c.cfg.checkpoint,
                              hf_has_expert_bias=getattr(adapter, "hf_has_expert_bias", False),
                              changed_from_defaults=changed,
                              lora_frozen_base="lora" in c.cfg.model.converters and not c.cfg.lora.train_base))
    from torchtitan.components.objectives.multi_token_prediction import config_problems as mtp_problems

    c.report("", mtp_problems(c.cfg.model, c.cfg.training, c.cfg.checkpoint, args))
    from torchtitan.components.optimizers.mup import config_problems as mup_problems

    c.report("", mup_problems(c.cfg.model, c.cfg.optimizer, c.cfg.checkpoint, args))
    from torchtitan.components.optimizers.qk_clip import config_problems as qk_clip_problems

    c.report("", qk_clip_problems(c.cfg.optimizer, c.cfg.model.name, args))
    if c.cfg.parallelism.pipeline_parallel_degree > 1:
        from torchtitan.distributed.pipeline_parallel import config_problems

        c.report("", config_problems(c.cfg.parallelism, c.cfg.training, c.cfg.validation, c.cfg.model,
                                     pipelining_fn_of(spec) is not None, args))


def _check_converters(c: _Checker) -> None:
    from torchtitan.protocols.model_converter import config_problems

    c.report("model", config_problems(c.cfg.model.converters))
    # A [lora] setting off its default does nothing without the converter (a resolved config.toml holds them all).
    changed = [f"lora.{name}" for name in changed_fields(c.cfg.lora)]
    c.require("model.converters", "lora" in c.cfg.model.converters or not changed,
              f"does not list 'lora', but {', '.join(changed)} is set; add 'lora' to model.converters (or remove "
              "the [lora] settings)")
    if "lora" in c.cfg.model.converters:
        from torchtitan.components.lora.converter import config_problems as lora_problems

        c.report("", lora_problems(c.cfg.lora, c.cfg.model.converters, c.cfg.parallelism,
                                   c.cfg.training.enable_cpu_offload))


def _check_data(c: _Checker) -> None:
    from torchtitan.components.evaluation.validate import config_problems
    from torchtitan.data.mixture import config_problems as mixture_problems
    from torchtitan.data.sources import source_problems

    for section, split in (("training", "train"), ("validation", "validation")):
        s = getattr(c.cfg, section)
        if section == "validation" and not s.enable:
            continue
        # A registered dataset can always be swapped for local files.
        c.report(section, [(field, reason if field == "dataset_path" else f"{reason} (or set {section}.dataset_path)")
                           for field, reason in source_problems(s.dataset, s.dataset_path, split,
                                                                getattr(s, "dataset_format", "text"))])
    c.report("validation", config_problems(c.cfg.validation, c.cfg.training.seq_len))
    c.report("data", mixture_problems(c.cfg.data, c.cfg.training))
    reads_shards = c.cfg.training.dataset_format == "tokens" or any(s.kind == "tokens" for s in c.cfg.data.sources)
    c.require("training.shuffle_documents", not c.cfg.training.shuffle_documents or reads_shards,
              "shuffles only pre-tokenized shards (dataset_format 'tokens' or a [[data.sources]] of kind 'tokens')")


def _check_checkpoint(c: _Checker, world_size: int) -> None:
    from torchtitan.components.checkpointing.checkpoint import config_problems
    from torchtitan.protocols.train_spec import get_train_spec

    has_adapter = get_train_spec(c.cfg.model.name).state_dict_adapter is not None
    c.report("checkpoint", config_problems(c.cfg.checkpoint, world_size, c.cfg.model.name, has_adapter))
    from torchtitan.components.step_guard import config_problems as guard_problems

    c.report("training.guard", guard_problems(c.cfg.training.guard))
    from torchtitan.remote import is_url

    c.require("job.dump_folder", not is_url(c.cfg.job.dump_folder), "is a URL, but metrics, TensorBoard, traces "
              "and the config copy are written to local files; keep it local and set checkpoint.folder to a URL "
              "to keep checkpoints in remote storage")


def _check_fault_tolerance(c: _Checker) -> None:
    from torchtitan.components.fault_tolerance import config_problems

    cfg = c.cfg
    c.report("fault_tolerance", config_problems(cfg.fault_tolerance, cfg.optimizer.name, cfg.training.guard.enable,
                                                cfg.checkpoint.enable))


def _check_unsupported(c: _Checker) -> None:
    cfg = c.cfg
    c.not_yet("optimizer.early_step_in_backward", cfg.optimizer.early_step_in_backward, "early step in backward")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        option = ac.selective_ac_option
        c.require("activation_checkpoint.selective_ac_option",
                  option == "op" or (option.isdigit() and int(option) >= 1),
                  "is invalid; it must be a positive integer (checkpoint every N-th block) or 'op'")


def load_and_validate(argv: list[str]) -> JobConfig:
    """The config the command line names, custom modules imported and validated for this launch's world
    size (WORLD_SIZE, default 1); ConfigError otherwise. Shared by the trainer and ``python -m torchtitan.config``."""
    cfg, sources = load_config(argv)
    import_custom_modules(cfg, sources)
    validate_config(cfg, sources, launched_world_size())
    return cfg
