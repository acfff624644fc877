"""Registers 'qwen3_tied': Qwen3's debug flavor with tied embeddings (imported by tests via custom_import)."""

import dataclasses

from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols import register_train_spec

register_train_spec("qwen3_tied", decoder_train_spec(
    {"debugmodel": dataclasses.replace(qwen3_flavors["debugmodel"], tie_embeddings=True)}))
