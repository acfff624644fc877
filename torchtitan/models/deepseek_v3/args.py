"""DeepSeek-V3 hyper-parameters and the named flavors.

The shared decoder with multi-head latent attention (MLA, model.py) in every block and the shared MoE layer
configured as DeepSeek-V3 routes: sigmoid scores, group-limited top-k (a group scores the sum of its two best
experts), the chosen weights renormalised and scaled by ``route_scale``, shared experts, aux-loss-free bias
balancing; the first ``n_dense_layers`` blocks keep a dense SwiGLU of width ``inter_dim``.

RoPE rotates adjacent channel pairs (the "interleaved" layout of the released checkpoints) over the
``qk_rope_head_dim`` channels of each head only. YaRN (``rope_factor`` > 1) follows transformers'
DeepseekV3 (the frequencies blended between interpolation and extrapolation over the band set by
``beta_fast``/``beta_slow`` around ``original_seq_len``; cos/sin scaled by mscale(mscale)/mscale(mscale_all_dim);
the softmax scale multiplied by mscale(mscale_all_dim)^2), applied whatever the training length.

Sources of the published numbers:
- 671B: deepseek-ai/DeepSeek-V3 config.json (as the issue lists them; the same numbers appear in the
  DeepSeek-V3 technical report, arXiv 2412.19437, section 4.2, which also gives its one multi-token prediction
  module: num_nextn_predict_layers = 1, stored as model.layers.61).
- 16B: moonshotai/Moonlight-16B-A3B, as THUDM/slime's Megatron script and NVIDIA Megatron-Bridge's Moonlight
  config state them (27 layers, hidden 2048, dense width 11264, 16 heads, 64 routed experts of width 1408 plus
  2 shared, top-6, one group, route scale 2.446, first layer dense, RMSNorm eps 1e-5, rope theta 50,000, no YaRN).
  NOT VERIFIED against the model's own config.json here (no network): vocab 163,840, q_lora_rank none,
  kv_lora_rank 512, qk 128 + 64, v 128 (DeepSeek-V3's MLA sizes, which Moonlight is said to share).
- kimi_k2: the numbers the issue quotes from Kimi K2's published config; NOT VERIFIED here (no network):
  61 layers, hidden 7168, 64 heads, 384 experts + 1 shared, top-8, one group, first layer dense, route scale
  2.827, vocab 163,840, rope theta 50,000, YaRN factor 32; the MLA sizes, expert and dense widths are taken
  as DeepSeek-V3's.
- Multi-token prediction: 16B and kimi_k2 are built without it (mtp_depth 0; whether their released checkpoints
  carry MTP layers is NOT VERIFIED here); model.mtp_depth adds it to any flavor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.moe import MoEArgs
from torchtitan.models.shared.rope import RopeConvention, yarn_frequencies, yarn_mscale


@dataclass
class DeepseekV3ModelArgs(DecoderArgs):
    builds_mtp_blocks = True
    inter_dim: int = 18432
    """Width of the dense blocks' SwiGLU (HF: intermediate_size)."""
    q_lora_rank: int = 0
    """Rank of the low-rank query projection (0: a plain query projection)."""
    kv_lora_rank: int = 512
    """Rank of the joint key-value compression."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without RoPE."""
    qk_rope_head_dim: int = 64
    """Per-head query/key channels with RoPE (the rotary key is shared by all heads)."""
    v_head_dim: int = 128
    rope_factor: float = 1.0
    """YaRN context extension factor (1: no YaRN)."""
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    rope_convention: RopeConvention = "pairs"
    latent_norm_eps: float = 1e-6
    """Epsilon of the RMSNorms of MLA's latents (q and kv): transformers fixes it at 1e-6, whatever norm_eps."""
    mla_rope: bool = True
    """Rotate the qk_rope_head_dim channels (False: no positional encoding, Kimi Linear's MLA; they stay, shared)."""
    moe: MoEArgs | None = field(default_factory=lambda: MoEArgs(score_func="sigmoid", route_norm=True))

    @property
    def head_dim(self) -> int:
        """Query/key head size (the non-rotary and rotary parts together)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads  # MLA expands keys and values for every head

    @property
    def ffn_hidden_dim(self) -> int:
        return self.inter_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.attention_scale or self.head_dim**-0.5
        if self.rope_factor > 1 and self.mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim) ** 2
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """The factor on cos and sin (1 unless mscale and mscale_all_dim differ)."""
        if self.rope_factor <= 1:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.mscale) / yarn_mscale(self.rope_factor, self.mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    def rope_frequencies(self) -> torch.Tensor:
        return yarn_frequencies(self.qk_rope_head_dim, self.rope_theta, self.rope_factor, self.original_seq_len,
                                self.beta_fast, self.beta_slow)

    def check(self) -> list[tuple[str, str]]:
        problems = super().check()
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                 "v_head_dim": self.v_head_dim, "qk_nope_head_dim": self.qk_nope_head_dim}
        problems += [(name, f"{value} must be positive") for name, value in sizes.items() if value <= 0]
        if self.q_lora_rank < 0:
            problems.append(("q_lora_rank", f"{self.q_lora_rank} must be >= 0 (0: no low-rank query)"))
        if self.qk_rope_head_dim % 2:
            problems.append(("qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even for RoPE"))
        if self.v_head_dim > self.head_dim:
            problems.append(("v_head_dim", f"{self.v_head_dim} must not exceed the query/key head size "
                                           f"{self.head_dim} (the attention kernels pad values up to it)"))
        if self.rope_factor < 1:
            problems.append(("rope_factor", f"{self.rope_factor} must be >= 1 (1: no YaRN)"))
        return problems

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers + self.mtp_depth))

    def attention_flops_per_token(self, seq_len: int) -> float:
        # Scores use the query/key head size and the weighted sum the value head size: 6 * blocks * H * (qk + v)
        # * seq for forward and backward, multi-token prediction blocks included.
        return 6 * (self.n_layers + self.mtp_depth) * self.n_heads * (self.head_dim + self.v_head_dim) * seq_len

    def flops_per_token(self, num_params_without_embedding: int, seq_len: int) -> float:
        # Each multi-token prediction block also runs the shared output head again (its weight is counted once).
        mtp_heads = 6 * self.mtp_depth * (self.vocab_size or 0) * self.dim
        return super().flops_per_token(num_params_without_embedding, seq_len) + mtp_heads


DEEPSEEK_V3_VOCAB = 129280
KIMI_VOCAB = 163840


def _v3_moe(**overrides) -> MoEArgs:
    values = dict(num_experts=256, top_k=8, hidden_dim=2048, score_func="sigmoid", route_norm=True,
                  route_scale=2.5, n_groups=8, topk_group=4, shared_hidden_dim=2048)
    return MoEArgs(**{**values, **overrides})


deepseek_v3_flavors: dict[str, DeepseekV3ModelArgs] = {
    # Tiny, for CPU tests: 2 dense + 2 MoE blocks, 8 experts in 4 groups (top 2 from 2 groups), one shared
    # expert, YaRN on; the vocabulary is the tokenizer's.
    "debug": DeepseekV3ModelArgs(
        dim=64, n_layers=4, n_heads=4, inter_dim=128, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_dense_layers=2, norm_eps=1e-6, rope_factor=4.0, original_seq_len=64,
        mscale=1.0, mscale_all_dim=1.0,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="sigmoid", route_norm=True, route_scale=2.5,
                    n_groups=4, topk_group=2, shared_hidden_dim=32),
    ),
    "16B": DeepseekV3ModelArgs(
        dim=2048, n_layers=27, n_heads=16, inter_dim=11264, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=1, vocab_size=KIMI_VOCAB,
        norm_eps=1e-5, rope_theta=50000.0,
        moe=_v3_moe(num_experts=64, top_k=6, hidden_dim=1408, route_scale=2.446, n_groups=1, topk_group=1,
                    shared_hidden_dim=2 * 1408),
    ),
    "671B": DeepseekV3ModelArgs(
        dim=7168, n_layers=61, n_heads=128, inter_dim=18432, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=3, vocab_size=DEEPSEEK_V3_VOCAB,
        norm_eps=1e-6, rope_theta=10000.0, rope_factor=40.0, original_seq_len=4096, beta_fast=32.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0, moe=_v3_moe(), mtp_depth=1,
    ),
    "kimi_k2": DeepseekV3ModelArgs(
        dim=7168, n_layers=61, n_heads=64, inter_dim=18432, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=1, vocab_size=KIMI_VOCAB,
        norm_eps=1e-6, rope_theta=50000.0, rope_factor=32.0, original_seq_len=4096, beta_fast=1.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0,
        moe=_v3_moe(num_experts=384, route_scale=2.827, n_groups=1, topk_group=1),
    ),
}
deepseek_v3_flavors["debug_qlora"] = DeepseekV3ModelArgs(
    **{**deepseek_v3_flavors["debug"].__dict__, "q_lora_rank": 24})
