"""Qwen3 (dense): pre-norm decoder with RMSNorm, grouped-query attention with QK-norm, RoPE and SwiGLU.

Only the math lives here; parallelism is applied from the outside (parallelize.py). RoPE rotates
the two halves of each head (channel i with channel i + head_dim/2), the convention of the released
checkpoints, so Hugging Face weights load without permuting any projection.
"""

import torch
from torch import nn

from torchtitan.models.attention import causal_attention
from torchtitan.models.llama3.model import FeedForward
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.seeded_init import canonical_name, decoder_fill, init_param_


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


class Attention(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # The attention kernel; context parallelism swaps in one that attends over a sharded sequence.
        self.attention_fn = causal_attention
        # QK-norm: one RMSNorm weight of size head_dim shared by all heads, which keeps the attention
        # logits bounded without a per-head parameter (and lets TP ranks hold it whole).
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a subset of the heads.
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attention_fn(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3Model(nn.Module):
    """The Qwen3 dense decoder. tok_embeddings, norm and output may be None on pipeline stages."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        if args.vocab_size is None:
            raise ValueError("Qwen3ModelArgs.vocab_size is None; call args.finalize() before building the model")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps parameter names ("layers.7.…") stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope", rope_table(args), persistent=False)

    def tie_weights(self) -> None:
        """Make the output projection share the embedding table, when the flavor ties them.

        Needed again whenever parameters are replaced module by module (to_empty, TP distribution),
        because those give each module its own tensor.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise from ``seed``; identical on any parallel layout (see seeded_init)."""
        self.rope = rope_table(self.args, buffer_device or self.rope.device)
        self.tie_weights()
        for name, param in self.named_parameters():
            name = canonical_name(name)
            init_param_(param, name, seed, decoder_fill(name, self.args.dim, self.args.tie_embeddings))
