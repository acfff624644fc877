"""Llama 3 weights to and from Hugging Face transformers' LlamaForCausalLM naming.

Our attention applies RoPE to adjacent channel pairs (2i, 2i+1) of each head; transformers rotates
the two halves of each head (i, i + head_dim/2). The q and k projection rows are permuted to match.
"""

import re

import torch

from torchtitan.models.llama3.args import Llama3ModelArgs

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, dim = w.shape
    return w.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


class Llama3StateDictAdapter:
    def __init__(self, args: Llama3ModelArgs):
        self.args = args

    def _heads_for(self, name: str) -> int | None:
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in state.items():
            if (heads := self._heads_for(name)) is not None:
                tensor = _pairs_to_halves(tensor, heads)
            if match := _OURS.match(name):
                out[f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"] = tensor
            else:
                out[_TOP_NAMES[name]] = tensor
        if self.args.tie_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layer_names = {hf: ours for ours, hf in _LAYER_NAMES.items()}
        top_names = {hf: ours for ours, hf in _TOP_NAMES.items()}
        out = {}
        for name, tensor in state.items():
            if match := _HF.match(name):
                ours = f"layers.{match.group(1)}.{layer_names[match.group(2)]}"
            elif name in top_names:
                ours = top_names[name]
            else:
                raise KeyError(f"unexpected Hugging Face weight '{name}' for a Llama model")
            if (heads := self._heads_for(ours)) is not None:
                tensor = _halves_to_pairs(tensor, heads)
            out[ours] = tensor
        if "output.weight" not in out and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]  # tied in the HF file
        return out

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        a = self.args
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": a.tie_embeddings,
            "bos_token_id": tokenizer_bos,
            "eos_token_id": tokenizer_eos,
            "torch_dtype": dtype,
        }
        if a.rope_scaling is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": a.rope_scaling.factor,
                "low_freq_factor": a.rope_scaling.low_freq_factor,
                "high_freq_factor": a.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": a.rope_scaling.original_max_position_embeddings,
            }
        return config
