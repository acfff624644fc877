"""Llama 3 hyper-parameters and the named flavors.

What is Llama's own: the feed-forward width rule (8/3 dim, scaled, rounded up to a multiple) and the
Llama 3.1 RoPE frequency scaling; RoPE rotates adjacent channel pairs.
"""

import math
from dataclasses import dataclass

import torch

from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.rope import rope_frequencies


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are stretched by ``factor``, short ones kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def scaled_rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each of the head_dim/2 channel pairs, with optional Llama 3.1 scaling."""
    freqs = rope_frequencies(head_dim, theta)
    if scaling is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    # Between the two wavelengths, blend the scaled and unscaled frequency.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


@dataclass
class Llama3ModelArgs(DecoderArgs):
    rope_theta: float = 500000.0
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_scaling: RopeScaling | None = None
    hidden_dim: int = 0
    """Width of the SwiGLU feed-forward stated outright (HF: intermediate_size; a checkpoint imported at its own
    dimensions); 0: Llama's rule from dim, ffn_dim_multiplier and multiple_of."""

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim:
            return self.hidden_dim
        hidden = 8 * self.dim // 3
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def rope_frequencies(self) -> torch.Tensor:
        return scaled_rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)

    def check(self) -> list[tuple[str, str]]:
        if self.n_heads > 0 and self.dim % self.n_heads:  # head_dim is derived from dim
            return [("dim", f"{self.dim} is not divisible by n_heads={self.n_heads}")]
        return super().check()


def _research(dim: int, n_layers: int, n_heads: int, n_kv_heads: int) -> Llama3ModelArgs:
    # Small-budget research sizes (vocab from the tokenizer).
    return Llama3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim_multiplier=1.3, multiple_of=128, rope_theta=10000.0,
    )


LLAMA3_VOCAB = 128256

llama3_flavors: dict[str, Llama3ModelArgs] = {
    "tiny": Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, rope_theta=10000.0),
    "debugmodel": Llama3ModelArgs(dim=256, n_layers=6, n_heads=16, multiple_of=256),
    "60M": _research(384, 22, 6, 2),
    "200M": _research(768, 24, 12, 4),
    "400M": _research(960, 30, 15, 5),
    "600M": _research(1152, 32, 18, 6),
    "1.1B": _research(1536, 32, 24, 8),
    "8B": Llama3ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_scaling=RopeScaling(),
    ),
    "70B": Llama3ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3, multiple_of=4096, rope_scaling=RopeScaling(),
    ),
    "405B": Llama3ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=LLAMA3_VOCAB,
        ffn_dim_multiplier=1.2, multiple_of=4096, rope_scaling=RopeScaling(),
    ),
}
