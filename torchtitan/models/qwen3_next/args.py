"""Qwen3-Next hyper-parameters and the named flavors.

A hybrid: of every ``full_attention_interval`` blocks, the last uses gated attention and the others Gated DeltaNet
(models/shared/gated_deltanet.py); every block's feed-forward is a Mixture-of-Experts with one sigmoid-gated shared
expert. The attention is Qwen3's (QK-norm, RoPE over the halves of the rotary channels) with only the first
``partial_rotary_factor`` of each head rotated and a sigmoid output gate.

80B-A3B: the widths are those of transformers' Qwen3NextConfig defaults (hidden 2048, 48 layers, head_dim 256,
16 query / 2 key-value heads, linear heads 16 key / 32 value of size 128, conv 4, 512 experts of width 512, top 10,
vocabulary 151,936); rope theta 1e7, 262,144 positions, dense width 5120 and a 25% rotary part are from the
released Qwen/Qwen3-Next-80B-A3B config.json.
"""

import dataclasses
from dataclasses import dataclass, field

from torchtitan.models.qwen3.args import QWEN3_VOCAB, Qwen3ModelArgs
from torchtitan.models.shared.moe import MoEArgs
from torchtitan.models.shared.rope import rope_frequencies

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Qwen3NextModelArgs(Qwen3ModelArgs):
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 16
    n_kv_heads: int | None = 2
    head_dim: int = 256
    hidden_dim: int = 5120
    """Width of a dense feed-forward (HF: intermediate_size); unused while every block is MoE."""
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 4096
    partial_rotary_factor: float = 0.25
    """The share of each attention head's channels that RoPE rotates (the first ones)."""
    full_attention_interval: int = 4
    """Every this many blocks, the last is full (gated) attention; the others are Gated DeltaNet."""
    linear_n_key_heads: int = 16
    linear_n_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    """Width of the causal depthwise conv over the linear layers' q, k and v."""
    moe: MoEArgs | None = field(default_factory=lambda: MoEArgs(
        num_experts=512, top_k=10, hidden_dim=512, score_func="softmax", route_norm=True, shared_hidden_dim=512,
        shared_gate=True))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_frequencies(self):
        return rope_frequencies(self.rotary_dim, self.rope_theta)

    def layer_type(self, layer_id: int) -> str:
        return FULL if (layer_id + 1) % self.full_attention_interval == 0 else LINEAR

    @property
    def layer_types(self) -> list[str]:
        return [self.layer_type(i) for i in range(self.n_layers)]

    @property
    def n_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    def check(self) -> list[tuple[str, str]]:
        problems = super().check()
        if problems:
            return problems
        if self.full_attention_interval < 1:
            problems.append(("full_attention_interval", f"{self.full_attention_interval} must be >= 1"))
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            problems.append(("partial_rotary_factor", f"{self.partial_rotary_factor} gives {self.rotary_dim} rotary "
                                                      f"channels of head_dim {self.head_dim}; it must be an even "
                                                      "number in (0, head_dim]"))
        for name in ("linear_n_key_heads", "linear_n_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel"):
            if getattr(self, name) <= 0:
                problems.append((name, f"{getattr(self, name)} must be positive"))
        if not problems and self.linear_n_value_heads % self.linear_n_key_heads:
            problems.append(("linear_n_value_heads", f"{self.linear_n_value_heads} is not a multiple of "
                                                     f"linear_n_key_heads = {self.linear_n_key_heads}"))
        return problems

    def check_tensor_parallel(self, tp: int) -> list[tuple[str, str]]:
        # Each rank holds whole linear key heads with their value heads (and the conv channels of both).
        return super().check_tensor_parallel(tp) + [
            (name, f"{getattr(self, name)} is not divisible by the tensor-parallel degree {tp}")
            for name in ("linear_n_key_heads", "linear_n_value_heads") if getattr(self, name) % tp]

    @property
    def n_attention_layers(self) -> int:
        return self.n_full_layers

    def mixer_flops_per_token(self) -> float:
        """Per linear block, its recurrence per value head: forward S^T k, the rank-one write and S^T q (6 K V),
        times 3 for forward and backward (nothing grows with the sequence), and the conv's 6 * kernel per
        channel."""
        k, v = self.linear_key_head_dim, self.linear_value_head_dim
        channels = self.linear_n_key_heads * 2 * k + self.linear_n_value_heads * v
        per_block = 18 * self.linear_n_value_heads * k * v + 6 * self.linear_conv_kernel * channels
        return (self.n_layers - self.n_full_layers) * per_block


qwen3_next_flavors: dict[str, Qwen3NextModelArgs] = {
    # Tiny, for CPU tests: 3 linear blocks and 1 full one, 8 experts (top 2) with a gated shared expert.
    "debugmodel": Qwen3NextModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128, rope_theta=10_000.0,
        linear_n_key_heads=2, linear_n_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="softmax", route_norm=True,
                    shared_hidden_dim=32, shared_gate=True),
    ),
    "80B-A3B": Qwen3NextModelArgs(vocab_size=QWEN3_VOCAB, max_seq_len=262_144),
}
# The debug model with gated attention in every block (same widths and depth): the full-attention baseline of
# benchmarks/hybrid_seq_scaling.py.
qwen3_next_flavors["debugmodel_attention_only"] = dataclasses.replace(qwen3_next_flavors["debugmodel"],
                                                                      full_attention_interval=1)
