"""Qwen3 weights to and from Hugging Face transformers' Qwen3ForCausalLM naming.

Both sides rotate the two halves of each head in RoPE, so tensors map one to one by name only.
"""

import re

import torch

from torchtitan.models.qwen3.args import Qwen3ModelArgs

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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


def _rename(name: str, layer_pattern: re.Pattern, layer_names: dict, top_names: dict, layer_prefix: str) -> str:
    if match := layer_pattern.match(name):
        if match.group(2) in layer_names:
            return f"{layer_prefix}{match.group(1)}.{layer_names[match.group(2)]}"
    elif name in top_names:
        return top_names[name]
    raise KeyError(f"unexpected weight '{name}' for a Qwen3 model")


class Qwen3StateDictAdapter:
    def __init__(self, args: Qwen3ModelArgs):
        self.args = args

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {_rename(name, _OURS, _LAYER_NAMES, _TOP_NAMES, "model.layers."): t for name, t in state.items()}
        if self.args.tie_embeddings:
            # Released tied checkpoints store only the embedding; safetensors also refuses shared storage.
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layer_names = {hf: ours for ours, hf in _LAYER_NAMES.items()}
        top_names = {hf: ours for ours, hf in _TOP_NAMES.items()}
        out = {_rename(name, _HF, layer_names, top_names, "layers."): t for name, t in state.items()}
        if self.args.tie_embeddings and "tok_embeddings.weight" in out:
            # One table serves both ends; an lm_head stored anyway (some exports do) must agree with it.
            if "output.weight" in out and not torch.equal(out["output.weight"], out["tok_embeddings.weight"]):
                raise ValueError("the flavor ties embeddings but the file's lm_head.weight differs from "
                                 "model.embed_tokens.weight")
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        a = self.args
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": a.dim,
            "intermediate_size": a.hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
            "tie_word_embeddings": a.tie_embeddings,
            "bos_token_id": tokenizer_bos,
            "eos_token_id": tokenizer_eos,
            "torch_dtype": dtype,
        }
