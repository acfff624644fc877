"""Qwen3-Next: the shared decoder with Gated DeltaNet in most blocks and gated attention in every
``full_attention_interval``-th, each followed by the shared MoE (with a sigmoid-gated shared expert).

Gated attention (per token x, heads of head_dim channels):

    [q | gate] = wq(x) per head;  k, v = wk(x), wv(x)
    q, k       = RMSNorm per head (QK-norm), then RoPE on their first rotary_dim channels
    out        = wo(attention(q, k, v) * sigmoid(gate))

Every RMSNorm of the blocks, of q and k, and the final one stores its weight zero-centred, scaling by (1 + w) and
starting at w = 0 (the released checkpoints' form); the Gated DeltaNet's output norm stores it plainly.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.qwen3_next.args import FULL, Qwen3NextModelArgs
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.decoder import Attention, Decoder, TransformerBlock
from torchtitan.models.shared.feed_forward import FeedForward
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet, gated_deltanet_fill
from torchtitan.models.shared.moe import MoE
from torchtitan.models.shared.rope import apply_rope
from torchtitan.models.shared.seeded_init import FillFn

ZERO_CENTRED = ("attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight", "attention.k_norm.weight")


class ZeroCentredRMSNorm(nn.RMSNorm):
    """RMSNorm whose weight w scales by (1 + w), computed in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, 1.0 + self.weight.float(), self.eps).type_as(x)


class GatedAttention(Attention):
    def __init__(self, args: Qwen3NextModelArgs):
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.rope_convention,
                         qk_norm_eps=args.norm_eps, scale=args.attention_scale)
        self.rotary_dim = args.rotary_dim
        # Each head's query followed by its gate, so that a rank holding whole heads holds their gates.
        self.wq = nn.Linear(args.dim, args.n_heads * 2 * args.head_dim, bias=False)
        self.q_norm = ZeroCentredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(args.head_dim, eps=args.norm_eps)

    def _rope(self, t: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        rotated = apply_rope(t[..., : self.rotary_dim], rope, self.rope_convention, positions)
        return torch.cat([rotated, t[..., self.rotary_dim:]], dim=-1)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bsz, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self._rope(self.q_norm(q), rope, positions), self._rope(self.k_norm(k), rope, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attention_fn(q, k, v, documents, scale=self.scale).transpose(1, 2)
        return self.wo((out * torch.sigmoid(gate)).reshape(bsz, seqlen, -1))


class Qwen3NextModel(Decoder):
    args: Qwen3NextModelArgs
    norm_cls = ZeroCentredRMSNorm

    def _block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        if a.layer_type(layer_id) == FULL:
            mixer: nn.Module = GatedAttention(a)
        else:
            mixer = GatedDeltaNet(a.dim, a.linear_n_key_heads, a.linear_n_value_heads, a.linear_key_head_dim,
                                  a.linear_value_head_dim, a.linear_conv_kernel, a.norm_eps)
        ffn = MoE(a.dim, a.moe) if a.is_moe_layer(layer_id) else FeedForward(a.dim, a.ffn_hidden_dim)
        return TransformerBlock(layer_id, a.dim, a.norm_eps, mixer, ffn, norm_cls=ZeroCentredRMSNorm)

    def _fill(self, name: str) -> FillFn:
        if name == "norm.weight" or name.endswith(ZERO_CENTRED):
            return lambda t, gen: t.zero_()
        return gated_deltanet_fill(name) or super()._fill(name)
