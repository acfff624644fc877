"""An outside model registered with torchtitan through the public extension API only.

    python -m torchtitan.train --job.config_file examples/nanogpt/nanogpt.toml
    (the TOML sets experimental.custom_import = "examples.nanogpt" and model.name = "nanogpt")
"""

from torch import nn

from examples.nanogpt.model import NanoGPT, NanoGPTArgs
from torchtitan.distributed.apply_common import apply_ac_compile_and_data_parallel
from torchtitan.protocols import TrainSpec, register_train_spec


def parallelize_nanogpt(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """No tensor-parallel plan: AC, compile and data parallelism from the shared helper."""
    if parallel_dims.tp_enabled:
        raise ValueError("nanogpt has no tensor-parallel plan; use data parallelism")
    return apply_ac_compile_and_data_parallel(model, parallel_dims, job_config)


register_train_spec(
    "nanogpt",
    TrainSpec(
        model_cls=NanoGPT,
        flavors={"tiny": NanoGPTArgs(dim=128, n_layers=2, n_heads=4), "small": NanoGPTArgs(dim=384, n_layers=6, n_heads=6)},
        parallelize_fn=parallelize_nanogpt,
    ),
)
