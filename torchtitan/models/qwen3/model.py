"""Qwen3 (dense): pre-norm decoder with RMSNorm, grouped-query attention with QK-norm, RoPE and SwiGLU.

What is Qwen3's own is its RoPE: it rotates the two halves of each head (channel i with channel
i + head_dim/2), the convention of the released checkpoints, so Hugging Face weights load without
permuting any projection; the rest is the shared decoder (models/decoder.py) with QK-norm on.
"""

import torch

from torchtitan.models.decoder import Attention, Decoder, FeedForward, TransformerBlock
from torchtitan.models.qwen3.args import Qwen3ModelArgs


def rope_table(args: Qwen3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every (position, frequency): shape (max_seq_len, head_dim/2, 2)."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (x[i], x[i + head_dim/2]) by frequency i for x of shape (batch, seq, heads, head_dim)."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)


class Qwen3Model(Decoder):
    """The Qwen3 dense decoder: Llama's layout plus QK-norm, half-split RoPE and optional tied embeddings."""

    def __init__(self, args: Qwen3ModelArgs):
        def make_block(layer_id: int) -> TransformerBlock:
            attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rope,
                                  qk_norm_eps=args.norm_eps)
            return TransformerBlock(layer_id, args.dim, args.norm_eps, attention,
                                    FeedForward(args.dim, args.hidden_dim))

        super().__init__(args, rope_table, make_block)
