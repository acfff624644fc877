"""A tensor- and expert-parallel model for the generation engine, parallelized by the trainer's own code.

    # torchrun --nproc_per_node 2 ...
    cfg = load_model_config("train_configs/debug_model.toml", ["--parallelism.tensor_parallel_degree", "2"])
    model = build_sharded_model(cfg)  # joins the process group; eval mode, initialised from debug.seed
    engine = GenerationEngine(model)  # every rank runs the same prompts; rank 0's choices are broadcast
    engine.load_weights(state)        # e.g. a checkpoint's or a policy's weights, whole tensors or DTensors

The model is built as the trainer builds it (the family's parallelize function: its tensor-parallel plan and the
MoE layers' expert parallelism) and initialised by seeded_init, so it holds the single process's exact weights.
Every rank runs the same batch, so only tensor and expert parallelism have a meaning here: the world size must be
tensor_parallel_degree x expert_parallel_degree. Expert parallelism's ranks are carved out of the data-parallel
shard ranks (distributed/parallel_dims.py), which here shard no batch and no parameters (no FSDP). What only
training needs is not applied: activation checkpointing, torch.compile (the caches swap the layers' attention
functions every generation), the chunked loss, multi-token prediction blocks.
"""

import dataclasses

import torch
from torch import nn

from torchtitan.components.expert_load import config_problems as moe_problems
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import device as device_lib
from torchtitan.distributed.apply_common import parallelize_fn_of
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.hardware import DTYPES
from torchtitan.protocols.model_converter import ModelConverters
from torchtitan.protocols.train_spec import build_model_args, model_config_problems


def layout_problems(cfg: JobConfig, world_size: int, model_args=None) -> list[tuple[str, str]]:
    """The first problem (full config key, reason to put after "key = value") with ``cfg.parallelism`` for
    generation on ``world_size`` ranks, or []; ``model_args`` (the finalized args) lets expert parallelism be
    checked against the model."""
    p = cfg.parallelism
    same_batch = "every rank runs the same batch in generation"
    if p.pipeline_parallel_degree != 1:
        return [("parallelism.pipeline_parallel_degree", ("is invalid: generation runs every block on every rank; "
                 "use 1"))]
    if p.context_parallel_degree != 1:
        return [("parallelism.context_parallel_degree", ("is invalid: the generation caches hold whole sequences on "
                 "every rank; use 1"))]
    if p.data_parallel_replicate_degree != 1:
        return [("parallelism.data_parallel_replicate_degree", f"is invalid: {same_batch}; use 1")]
    if p.tensor_parallel_degree < 1 or p.expert_parallel_degree < 1:
        return [("parallelism.tensor_parallel_degree" if p.tensor_parallel_degree < 1 else
                 "parallelism.expert_parallel_degree", "is invalid; it must be >= 1")]
    if p.data_parallel_shard_degree not in (-1, p.expert_parallel_degree):
        return [("parallelism.data_parallel_shard_degree", (f"is invalid: {same_batch}; use -1 (or "
                 f"expert_parallel_degree = {p.expert_parallel_degree}, the ranks expert parallelism is carved from)"))]
    ranks = p.tensor_parallel_degree * p.expert_parallel_degree
    if world_size != ranks:
        return [("parallelism.tensor_parallel_degree", (f"times expert_parallel_degree = {p.expert_parallel_degree} "
                 f"is {ranks}, but the world size is {world_size}: they must be equal, since {same_batch}"))]
    if model_args is not None and p.expert_parallel_degree > 1:
        return [(key, reason) for key, reason in moe_problems(cfg.moe, model_args, p.expert_parallel_degree,
                                                              cfg.checkpoint, hf_has_expert_bias=True)
                if key == "parallelism.expert_parallel_degree"][:1]
    return []


def checked_model_args(cfg: JobConfig, world_size: int):
    """(train spec, finalized model args without multi-token prediction) of the config's model, for generation on
    ``world_size`` ranks; ValueError (one line) for a model or layout generation cannot run."""
    problems, spec, _ = model_config_problems(cfg.model, cfg.training.seq_len, cfg.parallelism)
    args = None
    if not problems:
        args = build_model_args(spec, cfg.model, spec.build_tokenizer_fn(cfg.model.hf_assets_path).vocab_size,
                                cfg.training.seq_len, mtp=False)
        problems = layout_problems(cfg, world_size, args)
    if problems:
        key, reason = problems[0]
        raise ValueError(f"{key} = {getattr(cfg.parallelism, key.removeprefix('parallelism.'))} {reason}")
    return spec, args


def build_sharded_model(cfg: JobConfig) -> nn.Module:
    """The config's model in eval mode, tensor/expert parallel as ``cfg.parallelism`` says over this torchrun
    world (joined here if it is not yet), materialised on this rank's device and initialised from debug.seed;
    ValueError (one line) for a layout generation cannot run, before joining. On one process: the plain model."""
    world_size = device_lib.world_size()
    spec, args = checked_model_args(cfg, world_size)
    device = device_lib.init_distributed(cfg.comm.init_timeout_seconds)
    dims = dataclasses.replace(ParallelDims.from_config(cfg.parallelism, world_size), data_parallel=False)
    dims.build_mesh(device.type)
    # Training's memory and speed trades are not the engine's (see the module docstring).
    cfg = dataclasses.replace(
        cfg, activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, mode="none"),
        compile=dataclasses.replace(cfg.compile, enable=False),
        parallelism=dataclasses.replace(cfg.parallelism, enable_async_tensor_parallel=False))
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to(DTYPES[cfg.training.dtype])
    converters = ModelConverters(cfg.model.converters, cfg, dims)
    converters.convert(model)
    model = parallelize_fn_of(spec)(model, dims, cfg)
    model.to_empty(device=device)
    model.init_weights(cfg.debug.seed, buffer_device=device)
    converters.init_weights(model, cfg.debug.seed)
    return model.eval()
