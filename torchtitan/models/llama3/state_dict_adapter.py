"""Llama 3 weights to and from Hugging Face transformers' LlamaForCausalLM naming.

Our attention applies RoPE to adjacent channel pairs (2i, 2i+1) of each head; transformers rotates
the two halves of each head (i, i + head_dim/2). The q and k projection rows are permuted to match.
"""

import torch

from torchtitan.models.decoder_state_dict_adapter import DecoderStateDictAdapter
from torchtitan.models.llama3.args import Llama3ModelArgs


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, dim = w.shape
    return w.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


class Llama3StateDictAdapter(DecoderStateDictAdapter):
    family = "Llama"
    args: Llama3ModelArgs

    def _heads_for(self, name: str) -> int | None:
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self._heads_for(name)
        return tensor if heads is None else _pairs_to_halves(tensor, heads)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self._heads_for(name)
        return tensor if heads is None else _halves_to_pairs(tensor, heads)

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
