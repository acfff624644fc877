"""Qwen3 (dense) hyper-parameters and the named flavors.

What is Qwen3's own: QK-norm, RoPE over the two halves of each head (the layout of the released
checkpoints), and an attention width not tied to the model width: every flavor states its head_dim,
so n_heads * head_dim may differ from dim (Qwen3-0.6B: 16 x 128 = 2048 against dim 1024).
"""

from dataclasses import dataclass

from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.rope import RopeConvention


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8
    head_dim: int = 128
    hidden_dim: int = 3072
    """Width of the SwiGLU feed-forward (HF: intermediate_size)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_convention: RopeConvention = "halves"
    qk_norm: bool = True
    max_seq_len: int = 4096

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim


QWEN3_VOCAB = 151936


def _published(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool) -> Qwen3ModelArgs:
    # Every published dense size has 8 key/value heads of width 128 and the full Qwen vocabulary.
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, hidden_dim=hidden_dim,
        vocab_size=QWEN3_VOCAB, tie_embeddings=tie,
    )


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Attention wider than the model (8 x 64 = 512 > 256), as in 0.6B and 4B, so the small model used
    # by the tests exercises the same shapes that a head_dim derived from dim would get wrong.
    "debugmodel": Qwen3ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768),
    "0.6B": _published(1024, 28, 16, 3072, tie=True),
    "1.7B": _published(2048, 28, 16, 6144, tie=True),
    "4B": _published(2560, 36, 32, 9728, tie=True),
    "8B": _published(4096, 36, 32, 12288, tie=False),
    "14B": _published(5120, 40, 40, 17408, tie=False),
    "32B": _published(5120, 64, 64, 25600, tie=False),
}
