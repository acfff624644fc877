"""Llama 3 hyper-parameters and the named flavors."""

import dataclasses
import math
from dataclasses import dataclass

from torchtitan.protocols.model import BaseModelArgs


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are stretched by ``factor``, short ones kept."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class Llama3ModelArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = 8 * self.dim // 3
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def finalize(self, tokenizer_vocab_size: int, seq_len: int) -> "Llama3ModelArgs":
        return dataclasses.replace(
            self, vocab_size=self.vocab_size or tokenizer_vocab_size, max_seq_len=seq_len
        )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.dim % self.n_heads:
            problems.append(("dim", f"{self.dim} is not divisible by n_heads={self.n_heads}"))
        elif self.head_dim % 2:
            problems.append(("dim", f"head_dim {self.head_dim} must be even for RoPE"))
        if self.n_heads % self.kv_heads:
            problems.append(("n_kv_heads", f"{self.kv_heads} does not divide n_heads={self.n_heads}"))
        return problems

    def check_tensor_parallel(self, tp: int) -> list[tuple[str, str]]:
        # Each rank holds whole attention heads (query and key/value alike).
        return [
            (name, f"{value} is not divisible by the tensor-parallel degree {tp}")
            for name, value in (("n_heads", self.n_heads), ("n_kv_heads", self.kv_heads))
            if value % tp
        ]

    def flops_per_token(self, num_params_without_embedding: int, seq_len: int) -> float:
        # 6 FLOPs per weight per token for the matmuls, plus 12 * L * H * head_dim * seq_len for the
        # attention scores and weighted values (forward + backward, causal mask not discounted).
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6.0 * num_params_without_embedding + attention


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
