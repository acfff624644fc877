"""gpt-oss hyper-parameters and the named flavors.

Every block is attention (with biases on its projections, a learned sink logit per head, RoPE over the halves of
each head, YaRN) followed by a MoE: router with a bias, top-k of its logits renormalised (softmax over all then
renormalised over the chosen is the same), experts with biases and the clamped SwiGLU, no shared experts.
Even blocks see a sliding window of ``sliding_window`` tokens, odd blocks everything.

120b: transformers' GptOssConfig defaults (hidden 2880, 36 layers, 64 query / 8 KV heads of 64, 128 experts top 4 of
width 2880, vocabulary 201,088, window 128, rope theta 150,000 with YaRN factor 32 over 4,096 positions, RMSNorm eps
1e-5); 20b: the same with 24 layers and 32 experts.
"""

from dataclasses import dataclass, field

from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.moe import MoEArgs
from torchtitan.models.shared.rope import RopeConvention, yarn_frequencies, yarn_mscale

GPT_OSS_VOCAB = 201088


def _moe(num_experts: int, top_k: int, hidden_dim: int) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax", route_norm=True,
                   router_bias=True, expert_biases=True, activation="clamped_swiglu")


@dataclass
class GptOssModelArgs(DecoderArgs):
    dim: int = 2880
    n_layers: int = 36
    n_heads: int = 64
    n_kv_heads: int | None = 8
    head_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    rope_convention: RopeConvention = "halves"
    rope_factor: float = 32.0
    """YaRN context extension factor (1: no YaRN)."""
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    sliding_window: int = 128
    """Tokens a sliding-window block's queries see (themselves included); the even blocks slide."""
    moe: MoEArgs | None = field(default_factory=lambda: _moe(128, 4, 2880))

    @property
    def ffn_hidden_dim(self) -> int:
        # Every block is MoE; a dense block (n_dense_layers) would take the experts' width.
        return self.moe.hidden_dim if self.moe is not None else 0

    def window(self, layer_id: int) -> int | None:
        return self.sliding_window if layer_id % 2 == 0 else None

    def rope_frequencies(self):
        # gpt-oss does not round YaRN's ramp ends (transformers: truncate = false).
        return yarn_frequencies(self.head_dim, self.rope_theta, self.rope_factor, self.original_seq_len,
                                self.beta_fast, self.beta_slow, truncate=False)

    @property
    def rope_attention_factor(self) -> float:
        return yarn_mscale(self.rope_factor)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """12 * heads * head_dim per key a query attends: seq_len in the full blocks, the window in the sliding
        ones (causal mask not discounted, as for the other families)."""
        keys = sum(seq_len if self.window(i) is None else min(self.window(i), seq_len) for i in range(self.n_layers))
        return 12 * self.n_heads * self.head_dim * keys

    def check(self) -> list[tuple[str, str]]:
        if self.moe is None:
            return [("moe", "gpt-oss's blocks are Mixture-of-Experts: moe must be set")]
        problems = super().check()
        if self.sliding_window < 1:
            problems.append(("sliding_window", f"{self.sliding_window} must be >= 1"))
        if self.rope_factor < 1:
            problems.append(("rope_factor", f"{self.rope_factor} must be >= 1 (1: no YaRN)"))
        return problems


gpt_oss_flavors: dict[str, GptOssModelArgs] = {
    # Tiny, for CPU tests: 4 blocks (2 sliding windows of 16 tokens), 8 experts (top 2); the tokenizer's vocabulary.
    "debugmodel": GptOssModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, sliding_window=16,
                                  rope_theta=10_000.0, rope_factor=1.0, moe=_moe(8, 2, 32)),
    "20b": GptOssModelArgs(n_layers=24, moe=_moe(32, 4, 2880), vocab_size=GPT_OSS_VOCAB),
    "120b": GptOssModelArgs(vocab_size=GPT_OSS_VOCAB),
}
