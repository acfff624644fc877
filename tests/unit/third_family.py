"""A test-only decoder family registered from outside the package ('toy_decoder', via custom_import).

Its own field names (width, depth, ...) are unknown to the planner, which must read the model through
the DecoderArgs interface alone.
"""

import dataclasses
from dataclasses import dataclass

from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols import register_train_spec


@dataclass
class ToyArgs(DecoderArgs):
    ffn_ratio: int = 3
    """The feed-forward is ffn_ratio x dim wide."""

    @property
    def ffn_hidden_dim(self) -> int:
        return self.ffn_ratio * self.dim


toy_flavors = {"small": ToyArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_ratio=5, qk_norm=True,
                                rope_convention="halves", tie_embeddings=True)}
register_train_spec("toy_decoder", decoder_train_spec(toy_flavors))
toy_flavors["wide"] = dataclasses.replace(toy_flavors["small"], ffn_ratio=8)
