"""DecoderArgs: the hyper-parameters every decoder family has, under one set of names.

Code outside ``models/`` (validation, the planner, FLOP and MFU counting, parallelize, the pipeline
split, the HF adapters) reads a model's shape only through these fields and methods, so a new family
that subclasses DecoderArgs works with all of it. A family adds its own fields (Llama's FFN sizing
rule, Qwen3's explicit head_dim) and overrides the properties they feed.
"""

import dataclasses
from dataclasses import dataclass

import torch

from torchtitan.models.shared.moe import MoEArgs
from torchtitan.models.shared.mup import MupArgs
from torchtitan.models.shared.rope import RopeConvention, rope_frequencies
from torchtitan.protocols.model import BaseModelArgs


@dataclass
class DecoderArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    """Key/value heads of grouped-query attention; None: n_heads."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_convention: RopeConvention = "pairs"
    """Which channels RoPE rotates together (see models/shared/rope.py)."""
    qk_norm: bool = False
    """RMS-normalise q and k per head before RoPE."""
    max_seq_len: int = 2048
    """Set to training.seq_len by finalize()."""
    tie_embeddings: bool = False
    """The output projection shares the embedding table."""
    moe: MoEArgs | None = None
    """Mixture-of-Experts feed-forward in place of the dense one (None: every block is dense)."""
    n_dense_layers: int = 0
    """With moe: the first this many blocks keep the dense feed-forward (DeepSeek-V3: 3)."""
    mup: MupArgs | None = None
    """µP relative to a base width (models/shared/mup.py); None: the standard parametrization."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Width of the SwiGLU feed-forward."""
        raise NotImplementedError(f"{type(self).__name__} must define ffn_hidden_dim")

    @property
    def attention_scale(self) -> float | None:
        """The factor on q.k; None: the kernels' 1/sqrt(head_dim) (µP changes it away from the base head size)."""
        return self.mup.attention_scale(self.head_dim) if self.mup is not None else None

    @property
    def output_multiplier(self) -> float:
        """The factor on the logits: µP's base_width / dim, else 1."""
        return self.mup.width_ratio(self.dim) if self.mup is not None else 1.0

    @property
    def mup_changes_outputs(self) -> bool:
        """Whether µP's multipliers change this model's forward (away from the base width and head size)."""
        return self.output_multiplier != 1 or self.attention_scale is not None

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def rope_frequencies(self) -> torch.Tensor:
        """The head_dim/2 RoPE frequencies (a family overrides this to rescale them)."""
        return rope_frequencies(self.head_dim, self.rope_theta)

    @property
    def rope_attention_factor(self) -> float:
        """The factor on RoPE's cos and sin (YaRN's temperature; 1 without)."""
        return 1.0

    def finalize(self, tokenizer_vocab_size: int, seq_len: int):
        return dataclasses.replace(self, vocab_size=self.vocab_size or tokenizer_vocab_size, max_seq_len=seq_len)

    def with_mup(self, base_width: int, base_head_dim: int):
        return dataclasses.replace(self, mup=MupArgs(base_width, base_head_dim or self.head_dim))

    def check(self) -> list[tuple[str, str]]:
        sizes = {"dim": self.dim, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.kv_heads,
                 "head_dim": self.head_dim, "ffn_hidden_dim": self.ffn_hidden_dim}
        problems = [(name, f"{value} must be positive") for name, value in sizes.items() if value <= 0]
        if problems:
            return problems
        if self.head_dim % 2:
            problems.append(("head_dim", f"{self.head_dim} must be even for RoPE (it rotates channel pairs)"))
        if self.n_heads % self.kv_heads:
            problems.append(("n_kv_heads", f"{self.kv_heads} does not divide n_heads={self.n_heads}"))
        if self.mtp_depth < 0 or (self.mtp_depth and not self.builds_mtp_blocks):
            problems.append(("mtp_depth", f"{self.mtp_depth} is invalid; it must be >= 0 (0: no multi-token "
                                          "prediction), and 0 where the family builds no prediction blocks"))
        if self.mup is not None and min(self.mup.base_width, self.mup.base_head_dim) <= 0:
            problems.append(("mup", f"{self.mup} needs a positive base_width and base_head_dim"))
        if self.mup is not None and self.tie_embeddings:
            problems.append(("mup", "needs separate embedding and output matrices (µP scales them differently); "
                                    "this flavor ties them"))
        if self.moe is not None:
            problems += [(f"moe.{name}", reason) for name, reason in self.moe.check()]
            if not 0 <= self.n_dense_layers <= self.n_layers:
                problems.append(("n_dense_layers", f"{self.n_dense_layers} must be in [0, n_layers={self.n_layers}]"))
        return problems

    def check_tensor_parallel(self, tp: int) -> list[tuple[str, str]]:
        # Each rank holds whole query heads and whole key/value heads (QK-norm then works per local head),
        # and a slice of every expert's hidden width.
        sizes = [("n_heads", self.n_heads), ("n_kv_heads", self.kv_heads)]
        if self.moe is not None:
            sizes += [("moe.hidden_dim", self.moe.hidden_dim), ("moe.shared_hidden_dim", self.moe.shared_hidden_dim)]
        return [(name, f"{value} is not divisible by the tensor-parallel degree {tp}")
                for name, value in sizes if value % tp]

    def active_params(self, num_params_without_embedding: int) -> int:
        """Of the non-embedding parameters, those a token computes with: a MoE layer's routed experts count
        top_k of num_experts (the router and the shared experts count whole)."""
        if self.moe is None:
            return num_params_without_embedding
        idle = self.moe.routed_params(self.dim) * (self.moe.num_experts - self.moe.top_k) // self.moe.num_experts
        return num_params_without_embedding - self.n_moe_layers * idle

    @property
    def n_attention_layers(self) -> int:
        """Blocks that mix tokens with softmax attention (a hybrid family mixes the others another way)."""
        return self.n_layers

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The softmax attention's scores and weighted values, forward + backward, causal mask not discounted:
        12 * layers * heads * head_dim * seq_len."""
        return 12 * self.n_attention_layers * self.n_heads * self.head_dim * seq_len

    def mixer_flops_per_token(self) -> float:
        """Training FLOPs per token of token mixing that is neither weights nor softmax attention (a linear
        attention's recurrence); 0 for a transformer."""
        return 0.0

    def flops_per_token(self, num_params_without_embedding: int, seq_len: int) -> float:
        # 6 FLOPs per active weight per token for the matmuls, plus the attention's and any other mixer's own.
        # A tied output projection is still a matmul per token, but count_params drops it with the
        # embedding table it shares, so it is added back here.
        tied_output = self.vocab_size * self.dim if self.tie_embeddings and self.vocab_size else 0
        return (6.0 * (self.active_params(num_params_without_embedding) + tied_output)
                + self.attention_flops_per_token(seq_len) + self.mixer_flops_per_token())
