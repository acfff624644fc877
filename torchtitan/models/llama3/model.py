"""Llama 3: pre-norm decoder with RMSNorm, RoPE, grouped-query attention and SwiGLU.

Only the math lives here; parallelism is applied from the outside (parallelize.py).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.attention import causal_attention
from torchtitan.models.llama3.args import Llama3ModelArgs, RopeScaling
from torchtitan.models.seeded_init import canonical_name, decoder_fill, init_param_


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each of the head_dim/2 channel pairs, with optional Llama 3.1 scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
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


def rope_table(args: Llama3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every (position, channel pair): shape (max_seq_len, head_dim/2, 2)."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Llama3ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # The attention kernel; context parallelism swaps in one that attends over a sharded sequence.
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a subset of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attention_fn(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The Llama 3 decoder. tok_embeddings, norm and output may be None on pipeline stages."""

    def __init__(self, args: Llama3ModelArgs):
        super().__init__()
        assert args.vocab_size is not None, "call args.finalize() before building the model"
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps parameter names ("layers.7.…") stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise from ``seed``; identical on any parallel layout (see seeded_init)."""
        self.rope = rope_table(self.args, buffer_device or self.rope.device)
        if self.args.tie_embeddings:
            # Materialising from the meta device (to_empty) gives each module its own tensor again.
            self.output.weight = self.tok_embeddings.weight
        for name, param in self.named_parameters():
            name = canonical_name(name)
            init_param_(param, name, seed, decoder_fill(name, self.args.dim, self.args.tie_embeddings))
