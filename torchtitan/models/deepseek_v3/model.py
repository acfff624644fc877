"""DeepSeek-V3: the shared decoder with multi-head latent attention in every block.

Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1), per token x:

    q        = wq(x)                               or, with q_lora_rank, wq_b(q_norm(wq_a(x)))
    q        = [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)] per head; RoPE on q_rope
    c, k_r   = wkv_a(x) split into the latent (kv_lora_rank) and one rotary key shared by all heads
    k_nope,v = wkv_b(kv_norm(c)) split per head into qk_nope_head_dim and v_head_dim channels
    k        = [k_nope | RoPE(k_r)] per head
    out      = wo(attention(q, k, v, scale = softmax_scale))

The attention kernels take the explicit softmax scale (YaRN's correction) and values narrower than the
queries (models/shared/attention.py). Everything else is the shared decoder's: blocks, MoE, norms, output; multi-token
prediction adds blocks after the main ones (MultiTokenPredictionBlock).
"""

import torch
from torch import nn

from torchtitan.models.deepseek_v3.args import DeepseekV3ModelArgs
from torchtitan.models.shared.attention import DocumentMask, attend, note_max_logits
from torchtitan.models.shared.decoder import Decoder, TransformerBlock
from torchtitan.models.shared.feed_forward import FeedForward
from torchtitan.models.shared.moe import MoE
from torchtitan.models.shared.rope import apply_rope


def own_latents(latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return latent, k_rope


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args: DeepseekV3ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        self.rope_convention = args.rope_convention
        self.rotates = args.mla_rope
        qk_dim = args.head_dim
        if args.q_lora_rank > 0:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.latent_norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.latent_norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # The attention kernel, attention_fn(q, k, v, documents, scale=); context parallelism may swap it.
        self.attention_fn = attend
        # latent_fn(latent, k_rope) -> the latents and rotary keys attention reads: these tokens' own in training;
        # the generation engine swaps in its latent cache (torchtitan/generation/), which returns the history too.
        self.latent_fn = own_latents
        # QK-clip's per-head largest logit of the step (this rank's heads), noted while it is a tensor, by
        # max_logit_fn (see the shared Attention).
        self.logit_max: torch.Tensor | None = None
        self.max_logit_fn = note_max_logits

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 rather than n_heads: under tensor parallelism each rank holds a subset of the heads.
        q = q.view(bsz, seqlen, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)
        if self.rotates:
            q_rope = apply_rope(q_rope, rope, self.rope_convention, positions)
            k_rope = apply_rope(k_rope, rope, self.rope_convention, positions)
        q = torch.cat([q_nope, q_rope], dim=-1)
        latent, k_rope = self.latent_fn(latent, k_rope)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, latent.shape[1], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.logit_max is not None:
            self.max_logit_fn(self.logit_max, q, k, documents, self.softmax_scale)
        out = self.attention_fn(q, k, v, documents, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MultiTokenPredictionBlock(TransformerBlock):
    """Multi-token prediction module k (DeepSeek-V3, arXiv 2412.19437, section 2.2), a block after the main ones.

    At position i it combines the previous depth's hidden state h (the main model's last block output, before
    its final norm, for k = 1) with the embedding of the token k places ahead, input_ids[i + k]:
    eh_proj([enorm(embedding); hnorm(h)]), in the order the released checkpoints' eh_proj expects, then runs a
    block like the main ones. Its own final norm (HF: shared_head.norm) feeds the shared output head; the
    forward returns (hidden state for depth k + 1, normed hidden state), so the norm runs inside the block
    (under FSDP its weights are only gathered there).
    """

    def __init__(self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module):
        super().__init__(layer_id, dim, norm_eps, attention, feed_forward)
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, h: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None,
                embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(h)], dim=-1))
        h = super().forward(x, rope, documents=documents, positions=positions)
        return h, self.norm(h)


class DeepseekV3Model(Decoder):
    """The shared decoder with MLA blocks; the first n_dense_layers blocks dense, the others MoE; then
    ``mtp_depth`` multi-token prediction blocks (layers.{n_layers}, ...), run only when asked (training)."""

    args: DeepseekV3ModelArgs

    def __init__(self, args: DeepseekV3ModelArgs):
        super().__init__(args)
        # In ``layers`` so that FSDP, activation checkpointing, compile and the expert-load balancer treat them
        # as blocks; the names match the released checkpoints' model.layers.{n_layers + k}.
        for layer_id in range(args.n_layers, args.n_layers + args.mtp_depth):
            self.layers[str(layer_id)] = self._block(layer_id)

    def _block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        ffn = MoE(a.dim, a.moe) if a.is_moe_layer(layer_id) else FeedForward(a.dim, a.ffn_hidden_dim)
        block = MultiTokenPredictionBlock if layer_id >= a.n_layers else TransformerBlock
        return block(layer_id, a.dim, a.norm_eps, MultiHeadLatentAttention(a), ffn)

    def main_layers(self) -> list[nn.Module]:
        return [block for name, block in self.layers.items() if int(name) < self.args.n_layers]

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """As Decoder.forward; with ``mtp_tokens`` (batch, mtp_depth, seq), the token k places ahead of each
        position for depth k (components/objectives/multi_token_prediction.py), it returns (main output, the output of each
        depth ...): logits, or with ``labels`` the summed losses against ``mtp_labels`` (batch, depth, seq)."""
        documents = self._documents(document_ids)
        h = self.run_blocks(tokens, documents, positions)
        out = self.head(h, labels)
        if mtp_tokens is None or self.output is None:  # (an earlier pipeline stage: no prediction here)
            return out
        extra = [block for name, block in self.layers.items() if int(name) >= self.args.n_layers]
        if mtp_tokens.shape[1] != len(extra) or (labels is not None and mtp_labels is None):
            raise ValueError(f"multi-token prediction needs mtp_tokens for its {len(extra)} depths (got "
                             f"{mtp_tokens.shape[1]}), and mtp_labels with labels")
        predictions = []
        for depth, block in enumerate(extra):
            h, normed = block(h, self.rope, documents=documents, positions=positions,
                              embeddings=self.tok_embeddings(mtp_tokens[:, depth]))
            predictions.append(self._project(normed, None if labels is None else mtp_labels[:, depth]))
        return out, *predictions
