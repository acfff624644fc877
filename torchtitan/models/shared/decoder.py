"""The decoder-only transformer the model families share, built from their DecoderArgs.

embedding → n pre-norm blocks (grouped-query attention, a SwiGLU feed-forward or a Mixture-of-Experts) →
RMSNorm → output.
Only the math lives here; parallelism is applied from the outside (distributed/apply_common.py).
"""

import math

import torch
from torch import nn

from torchtitan.models.shared.attention import DocumentMask, attend, note_max_logits
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.feed_forward import FeedForward
from torchtitan.models.shared.moe import MoE
from torchtitan.models.shared.mup import hidden_matrices
from torchtitan.models.shared.rope import RopeConvention, apply_rope, rope_table
from torchtitan.models.shared.seeded_init import FillFn, canonical_name, decoder_fill, init_param_, scaled


class Attention(nn.Module):
    """Grouped-query attention with RoPE on q and k, optionally RMS-normalised per head first (QK-norm)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rope_convention: RopeConvention,
                 qk_norm_eps: float | None = None, bias: bool = False, scale: float | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.scale = scale  # on q.k; None: 1/sqrt(head_dim)
        self.rope_convention = rope_convention
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        # The attention kernel, attention_fn(q, k, v, documents); context parallelism swaps in one that
        # attends over a sharded sequence.
        self.attention_fn = attend
        # QK-clip's per-head largest logit of the step (this rank's heads), noted while it is a tensor, by
        # max_logit_fn(into, q, k, documents, scale, window=None); context parallelism swaps in one that sees the
        # other ranks' keys.
        self.logit_max: torch.Tensor | None = None
        self.max_logit_fn = note_max_logits
        if qk_norm_eps is not None:
            # One RMSNorm weight of size head_dim shared by all heads: it keeps the attention logits
            # bounded without a per-head parameter (and lets TP ranks hold it whole).
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``documents``: attend only within each document (block-causal); ``positions``: each token's RoPE
        position (batch, seq), else 0, 1, 2, ..."""
        bsz, seqlen, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a subset of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (apply_rope(t, rope, self.rope_convention, positions) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.logit_max is not None:
            self.max_logit_fn(self.logit_max, q, k, documents, self.scale)
        out = self.attention_fn(q, k, v, documents, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + ffn(norm(h)), where ffn is the dense
    ``feed_forward`` or, in a Mixture-of-Experts block, ``moe``."""

    def __init__(self, layer_id: int, dim: int, norm_eps: float, attention: nn.Module,
                 feed_forward: FeedForward | MoE, norm_cls: type[nn.Module] = nn.RMSNorm):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = norm_cls(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = norm_cls(dim, eps=norm_eps)
        self.moe_enabled = isinstance(feed_forward, MoE)
        if self.moe_enabled:
            self.moe = feed_forward
        else:
            self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        # Keyword arguments: tensor-parallel input plans address the attention's positional inputs.
        h = x + self.attention(self.attention_norm(x), rope, documents=documents, positions=positions)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Decoder(nn.Module):
    """Embedding, blocks, norm and output; tok_embeddings, norm and output may be None on pipeline stages."""

    # Build flex attention's block mask for block-causal batches on CUDA; context parallelism turns it off
    # (its attention splits its blocks by document itself).
    flex_block_mask = True
    # Whether forward's input is token ids; a later pipeline stage gets hidden states (and may still hold a copy of
    # the embedding, for an output head tied to it or for multi-token prediction).
    embeds_input = True
    # The RMSNorm of the blocks and of the output (a family may store its weights otherwise).
    norm_cls: type[nn.Module] = nn.RMSNorm

    def __init__(self, args: DecoderArgs):
        super().__init__()
        if args.vocab_size is None:
            raise ValueError(f"{type(args).__name__}.vocab_size is None; call args.finalize() before building "
                             "the model")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps parameter names ("layers.7.…") stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): self._block(i) for i in range(args.n_layers)})
        self.norm = self.norm_cls(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def _block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.kv_heads, a.head_dim, a.rope_convention,
                              qk_norm_eps=a.norm_eps if a.qk_norm else None, scale=a.attention_scale)
        ffn = MoE(a.dim, a.moe) if a.is_moe_layer(layer_id) else FeedForward(a.dim, a.ffn_hidden_dim)
        return TransformerBlock(layer_id, a.dim, a.norm_eps, attention, ffn)

    def _rope_table(self, device: torch.device | None = None) -> torch.Tensor:
        table = rope_table(self.args.rope_frequencies(), self.args.max_seq_len, device)
        return table if self.args.rope_attention_factor == 1 else table * self.args.rope_attention_factor

    def tie_weights(self) -> None:
        """Make the output projection share the embedding table, when the flavor ties them.

        Needed again whenever parameters are replaced module by module (to_empty, TP distribution),
        because those give each module its own tensor.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` (batch, seq), or hidden states on a later pipeline stage. ``document_ids`` (batch, seq),
        never decreasing along a row, makes attention block-causal; ``positions`` (batch, seq) are the RoPE
        positions (e.g. restarting at each document), else 0, 1, 2, ... ``labels`` (batch, seq) go to an output
        head that computes the loss itself (ChunkedLinearCrossEntropy): it then returns the summed loss."""
        return self.head(self.run_blocks(tokens, self._documents(document_ids), positions), labels)

    def main_layers(self) -> list[nn.Module]:
        """The blocks every forward runs, in order (a family's blocks that only training runs are left out)."""
        return list(self.layers.values())

    def run_blocks(self, tokens: torch.Tensor, documents: DocumentMask | None = None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states after the main blocks, before the final norm. The generation engine runs this and
        then ``head`` on the last position only (a vocabulary-wide output for every prompt token is its peak)."""
        h = self.tok_embeddings(tokens) if self.embeds_input else tokens
        for layer in self.main_layers():
            h = layer(h, self.rope, documents=documents, positions=positions)
        return h

    def _documents(self, document_ids: torch.Tensor | None) -> DocumentMask | None:
        return DocumentMask(document_ids, self.flex_block_mask) if document_ids is not None else None

    def head(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and output projection of the blocks' hidden states (the loss, with labels)."""
        return self._project(self.norm(h) if self.norm is not None else h, labels)

    def _project(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The output projection of normed hidden states (the loss, with labels); ``h`` itself on a stage
        without it."""
        if self.output is None:
            return h
        if self.args.output_multiplier != 1:  # µP: the projection is linear, so this scales the logits
            h = h * self.args.output_multiplier
        return self.output(h) if labels is None else self.output(h, labels=labels)

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise from ``seed``; identical on any parallel layout (see seeded_init)."""
        self.rope = self._rope_table(buffer_device or self.rope.device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers(buffer_device)
        self.tie_weights()
        # µP: the hidden matrices start sqrt(base_width / dim) times smaller (models/shared/mup.py).
        ratio = self.args.mup.width_ratio(self.args.dim) if self.args.mup is not None else 1.0
        hidden = hidden_matrices(self) if ratio != 1 else set()
        for name, param in self.named_parameters():
            canonical = canonical_name(name)
            fill = self._fill(canonical)
            init_param_(param, canonical, seed, scaled(fill, math.sqrt(ratio)) if name in hidden else fill)

    def _fill(self, name: str) -> FillFn:
        """How the parameter ``name`` (canonical) is initialised; a family with other parameters extends this."""
        return decoder_fill(name, self.args.dim, self.args.tie_embeddings)
