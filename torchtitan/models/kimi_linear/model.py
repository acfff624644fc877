"""Kimi Linear: the shared decoder with Kimi Delta Attention in most blocks and multi-head latent attention without
positional encoding in the others (``full_attention_layers``), each followed by DeepSeek-V3's MoE (args.py).

Kimi Delta Attention (Kimi Linear, arXiv 2510.26692) is Gated DeltaNet (models/shared/gated_deltanet.py) with a
decay per key channel instead of one per head, per token x:

    q, k, v  = SiLU(causal depthwise conv, kernel 4, over [q_proj | k_proj | v_proj](x))   (as many key heads as
               value heads; our fused in_proj_qkv holds each head's q, k and v together, like Gated DeltaNet's)
    q, k     = L2-normalised per head; q scaled by 1/sqrt(head size)
    beta     = sigmoid(b_proj(x))                                                   (per head)
    g        = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)                        (per head and key channel)
    o        = the gated delta rule with per-channel decay (models/shared/gated_delta_rule.py)
    out      = wo(RMSNorm(o) * sigmoid(g_b(g_a(x))))                                (the norm's weight shared by heads)

f_a / g_a are rank head-size projections: the decay and the output gate are low-rank.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.deepseek_v3.model import DeepseekV3Model, MultiHeadLatentAttention
from torchtitan.models.kimi_linear.args import FULL, KimiLinearModelArgs
from torchtitan.models.shared.decoder import TransformerBlock
from torchtitan.models.shared.feed_forward import FeedForward
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet, _local, gated_deltanet_fill
from torchtitan.models.shared.moe import MoE
from torchtitan.models.shared.seeded_init import FillFn


class ChannelDecay(nn.Module):
    """g = -exp(A_log[head]) * softplus(raw + dt_bias[head, channel]): the log of the state's decay per key channel
    and token (<= 0), from the low-rank projection ``raw`` (B, L, heads x head size)."""

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads * head_dim))

    def forward(self, raw: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        # At least float32, as Gated DeltaNet's decay: small decays are what keep long memory.
        raw = (raw.to(work) + _local(self.dt_bias).to(work)).view(*raw.shape[:2], -1, self.head_dim)
        return -_local(self.A_log).to(work).exp()[:, None] * F.softplus(raw)


class KimiDeltaAttention(GatedDeltaNet):
    def __init__(self, dim: int, n_heads: int, head_dim: int, conv_kernel: int, norm_eps: float):
        super().__init__(dim, n_heads, n_heads, head_dim, head_dim, conv_kernel, norm_eps)

    def _build_gates(self, dim: int, n_value_heads: int, value_head_dim: int) -> None:
        self.f_a_proj = nn.Linear(dim, value_head_dim, bias=False)
        self.f_b_proj = nn.Linear(value_head_dim, n_value_heads * value_head_dim, bias=False)
        self.decay = ChannelDecay(n_value_heads, value_head_dim)
        self.g_a_proj = nn.Linear(dim, value_head_dim, bias=False)
        self.g_b_proj = nn.Linear(value_head_dim, n_value_heads * value_head_dim, bias=False)

    def decay_of(self, x: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        return self.decay(self.f_b_proj(self.f_a_proj(x)), work)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.g_b_proj(self.g_a_proj(x)).view(*x.shape[:2], -1, self.value_head_dim))


class KimiLinearModel(DeepseekV3Model):
    args: KimiLinearModelArgs

    def _block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        ffn = MoE(a.dim, a.moe) if a.is_moe_layer(layer_id) else FeedForward(a.dim, a.ffn_hidden_dim)
        if a.layer_type(layer_id) == FULL:
            mixer: nn.Module = MultiHeadLatentAttention(a)
        else:
            mixer = KimiDeltaAttention(a.dim, a.kda_n_heads, a.kda_head_dim, a.kda_conv_kernel, a.norm_eps)
        return TransformerBlock(layer_id, a.dim, a.norm_eps, mixer, ffn)

    def _fill(self, name: str) -> FillFn:
        return gated_deltanet_fill(name) or super()._fill(name)
