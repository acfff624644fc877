"""Qwen3-MoE hyper-parameters and the named flavors.

Qwen3's attention (QK-norm, RoPE over the two halves of each head, head_dim stated per flavor) with every
block's feed-forward a Mixture-of-Experts: softmax scores over 128 experts, the top 8 kept and renormalised
(HF: norm_topk_prob = true), no shared experts, no dense blocks.

Published dimensions, from the Hugging Face config.json of each release (Qwen/Qwen3-30B-A3B and
Qwen/Qwen3-235B-A22B; the 235B numbers also as Megatron arguments in THUDM/slime's
scripts/models/qwen3-235B-A22B.sh). Not from transformers' Qwen3MoeConfig defaults, which describe a smaller
model (24 layers, rope theta 1e4, norm_topk_prob false).
"""

from dataclasses import dataclass, field

from torchtitan.models.qwen3.args import QWEN3_VOCAB, Qwen3ModelArgs
from torchtitan.models.shared.moe import MoEArgs


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    moe: MoEArgs | None = field(default_factory=MoEArgs)


def _published(dim: int, n_layers: int, n_heads: int, hidden_dim: int, expert_dim: int) -> Qwen3MoeModelArgs:
    # Both releases: 4 key/value heads of width 128, 128 experts with top-8 renormalised softmax routing,
    # RMSNorm eps 1e-6, rope theta 1e6, untied embeddings, the full Qwen vocabulary.
    return Qwen3MoeModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128, hidden_dim=hidden_dim,
        vocab_size=QWEN3_VOCAB, norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=False,
        moe=MoEArgs(num_experts=128, top_k=8, hidden_dim=expert_dim, score_func="softmax", route_norm=True),
    )


qwen3_moe_flavors: dict[str, Qwen3MoeModelArgs] = {
    # Tiny, for CPU tests: 4 MoE blocks of 8 experts (top 2); the vocabulary is the tokenizer's.
    "debugmodel": Qwen3MoeModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="softmax", route_norm=True),
    ),
    # hidden 2048, 48 layers, 32 query heads, expert width 768 (dense width 6144 is not used: no dense blocks).
    "30B-A3B": _published(2048, 48, 32, 6144, 768),
    # hidden 4096, 94 layers, 64 query heads, expert width 1536 (dense width 12288, likewise unused).
    "235B-A22B": _published(4096, 94, 64, 12288, 1536),
}
