"""An outside model registered with torchtitan through the public extension API only.

    python -m torchtitan.train --job.config_file examples/nanogpt/nanogpt.toml
    (the TOML sets experimental.custom_import = "examples.nanogpt" and model.name = "nanogpt")
"""

from torch import nn

from examples.nanogpt.model import NanoGPT, NanoGPTArgs
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp
from torchtitan.protocols import TrainSpec, register_train_spec


def parallelize_nanogpt(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """Data parallelism, AC and compile from the shared helpers; no tensor parallel plan."""
    if parallel_dims.tp_enabled:
        raise ValueError("nanogpt has no tensor-parallel plan; use data parallelism")
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option, ac.preserve_rng_state)
    if job_config.compile.enable:
        apply_compile(model, job_config.compile.backend)
    if parallel_dims.fsdp_enabled:
        apply_fsdp(model, parallel_dims.fsdp_mesh(), job_config.training.mixed_precision_param,
                   job_config.training.mixed_precision_reduce, job_config.parallelism.fsdp_reshard_after_forward)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.submesh("dp_replicate"))
    return model


register_train_spec(
    "nanogpt",
    TrainSpec(
        model_cls=NanoGPT,
        flavors={"tiny": NanoGPTArgs(dim=128, n_layers=2, n_heads=4), "small": NanoGPTArgs(dim=384, n_layers=6, n_heads=6)},
        parallelize_fn=parallelize_nanogpt,
    ),
)
