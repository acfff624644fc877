"""Registers 'qwen3_tied': Qwen3's debug flavor with tied embeddings (imported by tests via custom_import)."""

import dataclasses

from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3, qwen3_flavors
from torchtitan.protocols import TrainSpec, register_train_spec

register_train_spec(
    "qwen3_tied",
    TrainSpec(
        model_cls=Qwen3Model,
        flavors={"debugmodel": dataclasses.replace(qwen3_flavors["debugmodel"], tie_embeddings=True)},
        parallelize_fn=parallelize_qwen3,
    ),
)
