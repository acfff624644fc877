"""Qwen3.5 hyper-parameters and the named flavors: Qwen3-Next's hybrid decoder (Gated DeltaNet in three blocks of
four, gated attention in the fourth) reading images through the shared vision tower, with M-RoPE.

What differs from Qwen3-Next: the feed-forward is dense (a SwiGLU of width hidden_dim) unless a flavor has MoE (the
Qwen3.5-MoE models: every block the shared MoE with a sigmoid-gated shared expert, as Qwen3-Next); the attention's
rotary part (the first 25% of each head) reads three position streams interleaved by ``mrope_section`` (11, 11, 10
of its 32 frequencies in the released sizes). What differs from Qwen3-VL: the text decoder, and no DeepStack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.models.qwen3_next.args import Qwen3NextModelArgs
from torchtitan.models.qwen3_vl.args import DEBUG_VISION_TOKENS, VisionLanguageArgs
from torchtitan.models.shared.moe import MoEArgs
from torchtitan.models.shared.vision import VisionArgs

# Qwen3.5's vocabulary and its ids of the vision tokens (transformers' Qwen3_5Config defaults).
QWEN3_5_VOCAB = 248_320
QWEN3_5_VISION_START, QWEN3_5_VISION_END, QWEN3_5_IMAGE_PAD, QWEN3_5_VIDEO_PAD = 248053, 248054, 248056, 248057


@dataclass
class Qwen3_5ModelArgs(VisionLanguageArgs, Qwen3NextModelArgs):
    # The defaults are transformers' Qwen3_5TextConfig's (hidden 4096, 32 layers, 16 query / 4 key-value heads of
    # 256, feed-forward 12288, linear heads as Qwen3-Next's); dense unless a flavor gives moe.
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 16
    n_kv_heads: int | None = 4
    hidden_dim: int = 12288
    """Width of the dense SwiGLU feed-forward (HF: intermediate_size); unused in a MoE flavor."""
    moe: MoEArgs | None = None
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    image_token_id: int = QWEN3_5_IMAGE_PAD
    vision_start_token_id: int = QWEN3_5_VISION_START
    vision_end_token_id: int = QWEN3_5_VISION_END


# The released models' RoPE base: transformers' default is 1e4, but Qwen3-Next's released config.json has 1e7 and so
# does a public training recipe of Qwen3.5-35B-A3B (Miles: --rotary-base 10000000). A released checkpoint loaded into
# one of these flavors is compared key by key with its config.json, which names rope_theta if this is wrong.
RELEASED_THETA = 10_000_000.0

qwen3_5_flavors: dict[str, Qwen3_5ModelArgs] = {
    # Tiny, for CPU tests: 3 linear blocks and 1 full one, 16 rotary channels of 64 (8 frequencies: 3 temporal,
    # 3 height, 2 width, the released 11/11/10 in small), the 2-block debug tower of Qwen3-VL without DeepStack.
    "debugmodel": Qwen3_5ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, rope_theta=10_000.0,
        linear_n_key_heads=4, linear_n_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        mrope_section=(3, 3, 2),
        vision=VisionArgs(depth=2, dim=128, ffn_dim=384, n_heads=4, num_position_embeddings=256),
        **DEBUG_VISION_TOKENS),
    # Qwen3.5-9B: transformers' Qwen3_5TextConfig and Qwen3_5VisionConfig defaults, which its docstring calls the
    # Qwen3.5-9B configuration (the published model card gives the same: hidden 4096, 32 layers as 8 x (3 Gated
    # DeltaNet + 1 gated attention), attention 16 / 4 heads of 256 with 64 rotary channels, linear heads 16 QK /
    # 32 V of 128, feed-forward 12288, vocabulary 248,320, 262,144 positions); the tower's 27 blocks of width 1152
    # (ffn 4304, 16 heads, patch 16, merge 2, a 48 x 48 position table) write the decoder's width.
    "9B": Qwen3_5ModelArgs(vocab_size=QWEN3_5_VOCAB, max_seq_len=262_144, rope_theta=RELEASED_THETA),
    # Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults, which its docstring calls the Qwen3.5-35B-A3B
    # configuration (hidden 2048, 40 layers, 16 / 2 heads of 256, 256 experts of width 512 with top 8 and a gated
    # shared expert of 512, every block MoE), with the same tower defaults.
    "35B-A3B": Qwen3_5ModelArgs(
        dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, vocab_size=QWEN3_5_VOCAB, max_seq_len=262_144,
        rope_theta=RELEASED_THETA,
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=512, score_func="softmax", route_norm=True,
                    shared_hidden_dim=512, shared_gate=True)),
}
# The debug model with the Qwen3.5-MoE feed-forward in every block: 8 experts (top 2) and a gated shared expert.
qwen3_5_flavors["debugmodel_moe"] = dataclasses.replace(qwen3_5_flavors["debugmodel"], moe=MoEArgs(
    num_experts=8, top_k=2, hidden_dim=128, score_func="softmax", route_norm=True, shared_hidden_dim=128,
    shared_gate=True))
