"""Kimi Linear hyper-parameters and the named flavors.

A hybrid of DeepSeek-V3's pieces and Kimi Delta Attention: the blocks listed in ``full_attention_layers`` use
multi-head latent attention without positional encoding (MLA as DeepSeek-V3 defines it, models/deepseek_v3/, its
rotary key channels kept, shared by the heads, but never rotated), the others Kimi Delta Attention (model.py); the
feed-forward is DeepSeek-V3's MoE (sigmoid scores, groups, shared experts, aux-loss-free bias) after the first
``n_dense_layers`` dense blocks.

48B-A3B: the widths are transformers' KimiLinearConfig defaults, which it names after
moonshotai/Kimi-Linear-48B-A3B-Instruct (hidden 2304, 27 layers, 32 heads, MLA ranks 512 / 128 + 64 / 128, 256
experts of width 1024 plus 1 shared, top 8, route scale 2.446, one group, dense width 9216, RMSNorm eps 1e-5, KDA
32 heads of 128, conv 4, vocabulary 163,840, first block dense). The full-attention blocks (1-indexed 4, 8, 12, 16,
20, 24, 27 in the released config's linear_attn_config.full_attn_layers: one in four, and the last) are NOT VERIFIED
here (no network); transformers' own default pattern (every fourth from the fifth) differs, and a config.json that
names its layers is read as it says.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.deepseek_v3.args import KIMI_VOCAB, DeepseekV3ModelArgs
from torchtitan.models.shared.moe import MoEArgs

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class KimiLinearModelArgs(DeepseekV3ModelArgs):
    builds_mtp_blocks = False
    mla_rope: bool = False
    kda_n_heads: int = 32
    kda_head_dim: int = 128
    """Key and value head size of the Kimi Delta Attention blocks."""
    kda_conv_kernel: int = 4
    """Width of the causal depthwise conv over their q, k and v."""
    full_attention_layers: tuple[int, ...] = (3, 7, 11, 15, 19, 23, 26)
    """The blocks (from 0) with multi-head latent attention; the others use Kimi Delta Attention."""

    def layer_type(self, layer_id: int) -> str:
        return FULL if layer_id in self.full_attention_layers else LINEAR

    @property
    def layer_types(self) -> list[str]:
        return [self.layer_type(i) for i in range(self.n_layers)]

    @property
    def n_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def n_attention_layers(self) -> int:
        return self.n_full_layers

    def check(self) -> list[tuple[str, str]]:
        problems = super().check()
        for name in ("kda_n_heads", "kda_head_dim", "kda_conv_kernel"):
            if getattr(self, name) <= 0:
                problems.append((name, f"{getattr(self, name)} must be positive"))
        outside = [i for i in self.full_attention_layers if not 0 <= i < self.n_layers]
        if outside:
            problems.append(("full_attention_layers", f"{outside} are not blocks of the {self.n_layers} (0 to "
                                                      f"{self.n_layers - 1})"))
        if self.mtp_depth:
            problems.append(("mtp_depth", f"{self.mtp_depth}: Kimi Linear has no multi-token prediction; valid: 0"))
        return problems

    def check_tensor_parallel(self, tp: int) -> list[tuple[str, str]]:
        # Each rank holds whole KDA heads (and their conv channels and decay parameters).
        problems = super().check_tensor_parallel(tp)
        if self.kda_n_heads % tp:
            problems.append(("kda_n_heads", f"{self.kda_n_heads} is not divisible by the tensor-parallel degree {tp}"))
        return problems

    def attention_flops_per_token(self, seq_len: int) -> float:
        return self.n_full_layers * self.n_heads * 6 * (self.head_dim + self.v_head_dim) * seq_len

    def mixer_flops_per_token(self) -> float:
        """Per KDA block, its recurrence per head (6 K V forward, 3x with backward, as Gated DeltaNet's) and the
        conv's 6 * kernel per channel."""
        k = self.kda_head_dim
        per_block = 18 * self.kda_n_heads * k * k + 6 * self.kda_conv_kernel * 3 * self.kda_n_heads * k
        return (self.n_layers - self.n_full_layers) * per_block


kimi_linear_flavors: dict[str, KimiLinearModelArgs] = {
    # Tiny, for CPU tests: KDA, KDA, KDA, MLA; the first block dense, then 8 experts (top 2) and a shared one.
    "debugmodel": KimiLinearModelArgs(
        dim=64, n_layers=4, n_heads=4, inter_dim=128, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_dense_layers=1, norm_eps=1e-5, kda_n_heads=4, kda_head_dim=16, full_attention_layers=(3,),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="sigmoid", route_norm=True, route_scale=2.446,
                    shared_hidden_dim=32),
    ),
    "48B-A3B": KimiLinearModelArgs(
        dim=2304, n_layers=27, n_heads=32, inter_dim=9216, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=1, vocab_size=KIMI_VOCAB, norm_eps=1e-5,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=1024, score_func="sigmoid", route_norm=True,
                    route_scale=2.446, shared_hidden_dim=1024),
    ),
}
