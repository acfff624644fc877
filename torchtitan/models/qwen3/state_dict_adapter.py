"""Qwen3 weights to and from Hugging Face transformers' Qwen3ForCausalLM naming.

Both sides rotate the two halves of each head in RoPE, so tensors map one to one by name only.
"""

from typing import ClassVar

from torchtitan.models.decoder_state_dict_adapter import DecoderStateDictAdapter
from torchtitan.models.qwen3.args import Qwen3ModelArgs


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    family = "Qwen3"
    extra_layer_names: ClassVar[dict[str, str]] = {
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    args: Qwen3ModelArgs

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
