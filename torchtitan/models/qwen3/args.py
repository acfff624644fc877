"""Qwen3 (dense) hyper-parameters and the named flavors.

Unlike Llama, the attention width is not tied to the model width: every flavor states its head_dim,
so n_heads * head_dim may differ from dim (Qwen3-0.6B: 16 x 128 = 2048 against dim 1024).
"""

import dataclasses
from dataclasses import dataclass

from torchtitan.protocols.model import BaseModelArgs


@dataclass
class Qwen3ModelArgs(BaseModelArgs):
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden_dim: int = 3072
    """Width of the SwiGLU feed-forward (HF: intermediate_size)."""
    vocab_size: int | None = None
    """None: taken from the tokenizer by finalize()."""
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False

    def finalize(self, tokenizer_vocab_size: int, seq_len: int) -> "Qwen3ModelArgs":
        return dataclasses.replace(
            self, vocab_size=self.vocab_size or tokenizer_vocab_size, max_seq_len=seq_len
        )

    def check(self) -> list[tuple[str, str]]:
        problems = [
            (name, f"{value} must be positive")
            for name, value in (("dim", self.dim), ("n_layers", self.n_layers), ("n_heads", self.n_heads),
                                ("n_kv_heads", self.n_kv_heads), ("head_dim", self.head_dim),
                                ("hidden_dim", self.hidden_dim))
            if value <= 0
        ]
        if problems:
            return problems
        if self.head_dim % 2:
            problems.append(("head_dim", f"{self.head_dim} must be even for RoPE (it rotates channel pairs)"))
        if self.n_heads % self.n_kv_heads:
            problems.append(("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}"))
        return problems

    def check_tensor_parallel(self, tp: int) -> list[tuple[str, str]]:
        # Each rank holds whole query heads and whole key/value heads; QK-norm then works per local head.
        return [
            (name, f"{value} is not divisible by the tensor-parallel degree {tp}")
            for name, value in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads))
            if value % tp
        ]

    def flops_per_token(self, num_params_without_embedding: int, seq_len: int) -> float:
        # 6 FLOPs per weight per token for the matmuls, plus 12 * L * H * head_dim * seq_len for the
        # attention scores and weighted values (forward + backward, causal mask not discounted).
        # A tied output projection is still a matmul per token, but count_params drops it with the
        # embedding table it shares, so it is added back here.
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        tied_output = self.vocab_size * self.dim if self.tie_embeddings and self.vocab_size else 0
        return 6.0 * (num_params_without_embedding + tied_output) + attention


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
