"""A GPT-2-style decoder (learned positions, LayerNorm, GELU MLP), written as a user would: plain PyTorch."""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.shared.attention import causal_attention
from torchtitan.models.shared.seeded_init import canonical_name, init_param_, normal_, ones_
from torchtitan.protocols import BaseModelArgs


@dataclass
class NanoGPTArgs(BaseModelArgs):
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int | None = None
    max_seq_len: int = 256

    def finalize(self, tokenizer_vocab_size: int, seq_len: int) -> "NanoGPTArgs":
        return replace(self, vocab_size=self.vocab_size or tokenizer_vocab_size, max_seq_len=seq_len)

    def check(self) -> list[tuple[str, str]]:
        return [] if self.dim % self.n_heads == 0 else [("dim", f"{self.dim} not divisible by n_heads")]


class Block(nn.Module):
    def __init__(self, args: NanoGPTArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.ln_1 = nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)
        self.ln_2 = nn.LayerNorm(args.dim)
        self.fc = nn.Linear(args.dim, 4 * args.dim)
        self.fc_out = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(causal_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, args: NanoGPTArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if name.endswith("bias"):
                fill = lambda t, g: t.zero_()  # noqa: E731
            elif ".ln_" in name or name.startswith("norm"):
                fill = ones_
            elif name.endswith(("proj.weight", "fc_out.weight")):
                fill = normal_(0.02 / math.sqrt(2 * self.args.n_layers))
            else:
                fill = normal_(0.02)
            init_param_(param, name, seed, fill)
