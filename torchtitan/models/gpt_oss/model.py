"""gpt-oss: the shared decoder with attention sinks, alternating sliding-window and full attention, biased
projections and the shared MoE with biases and the clamped SwiGLU.

Attention per token x (heads of head_dim): q, k, v = wq(x), wk(x), wv(x) (with biases); RoPE on q and k; softmax
over the keys the block sees (the last ``sliding_window`` in a sliding block) and one more logit per head, the
sink, that takes attention mass and adds no value; out = wo(attention) (with a bias).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.gpt_oss.args import GptOssModelArgs
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.decoder import Attention, Decoder, TransformerBlock
from torchtitan.models.shared.feed_forward import FeedForward
from torchtitan.models.shared.moe import MoE
from torchtitan.models.shared.rope import apply_rope
from torchtitan.models.shared.seeded_init import FillFn


class SinkLogits(nn.Module):
    """One learned logit per head (``weight``), read by the attention as its sinks."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def local(self) -> torch.Tensor:
        # Under tensor parallelism each rank holds its own heads' sinks.
        return self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight


class SinkAttention(Attention):
    def __init__(self, args: GptOssModelArgs, window: int | None):
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.rope_convention, bias=True,
                         scale=args.attention_scale)
        self.window = window
        self.sinks = SinkLogits(args.n_heads)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = (apply_rope(t, rope, self.rope_convention, positions) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.logit_max is not None:
            self.max_logit_fn(self.logit_max, q, k, documents, self.scale, self.window)
        out = self.attention_fn(q, k, v, documents, scale=self.scale, window=self.window, sinks=self.sinks.local())
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class GptOssModel(Decoder):
    args: GptOssModelArgs

    def _block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        ffn = MoE(a.dim, a.moe) if a.is_moe_layer(layer_id) else FeedForward(a.dim, a.ffn_hidden_dim)
        return TransformerBlock(layer_id, a.dim, a.norm_eps, SinkAttention(a, a.window(layer_id)), ffn)

    def _fill(self, name: str) -> FillFn:
        if name.endswith("sinks.weight"):
            return lambda t, gen: t.zero_()  # the sink starts as one more key of logit 0
        return super()._fill(name)
