"""Decoder weights to and from Hugging Face transformers' *ForCausalLM naming, shared by the families.

A family adds its own per-layer names, its config.json identity and extra keys. Hugging Face's Llama
and Qwen3 rotate the two halves of each head in RoPE; for a family whose RoPE rotates adjacent pairs
(args.rope_convention = "pairs") the q and k projection rows are permuted between the two layouts.
"""

import re
from typing import ClassVar

import torch

# Our name within layers.N -> the Hugging Face name within model.layers.N.
DECODER_LAYER_NAMES = {
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
DECODER_TOP_NAMES = {
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


class DecoderStateDictAdapter:
    """Renames every tensor; subclasses set ``family``, ``hf_architecture``, ``hf_model_type`` and
    ``extra_layer_names`` and may add config keys (``extra_hf_config``) or convert tensors."""

    family: ClassVar[str] = "decoder"
    hf_architecture: ClassVar[str] = ""
    hf_model_type: ClassVar[str] = ""
    extra_layer_names: ClassVar[dict[str, str]] = {}

    def __init__(self, args):
        self.args = args
        self._layer_to_hf = {**DECODER_LAYER_NAMES, **self.extra_layer_names}
        self._layer_from_hf = {hf: ours for ours, hf in self._layer_to_hf.items()}
        self._top_from_hf = {hf: ours for ours, hf in DECODER_TOP_NAMES.items()}

    def _rope_heads(self, name: str) -> int | None:
        """Heads of a q or k projection whose rows need permuting between RoPE layouts, else None."""
        if self.args.rope_convention != "pairs":
            return None
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``name`` in the Hugging Face layout."""
        heads = self._rope_heads(name)
        return tensor if heads is None else _pairs_to_halves(tensor, heads)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The Hugging Face tensor for our ``name`` in our layout."""
        heads = self._rope_heads(name)
        return tensor if heads is None else _halves_to_pairs(tensor, heads)

    def hf_config(self, tokenizer_bos: int, tokenizer_eos: int, dtype: str) -> dict:
        """config.json for transformers' AutoConfig."""
        a = self.args
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.hf_model_type,
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
            "tie_word_embeddings": a.tie_embeddings,
            "bos_token_id": tokenizer_bos,
            "eos_token_id": tokenizer_eos,
            "torch_dtype": dtype,
            **self.extra_hf_config(),
        }

    def extra_hf_config(self) -> dict:
        """The family's own config.json keys."""
        return {}

    def _hf_name(self, name: str) -> str:
        if (match := _OURS.match(name)) and match.group(2) in self._layer_to_hf:
            return f"model.layers.{match.group(1)}.{self._layer_to_hf[match.group(2)]}"
        if name in DECODER_TOP_NAMES:
            return DECODER_TOP_NAMES[name]
        raise KeyError(f"weight '{name}' has no Hugging Face name for a {self.family} model")

    def _our_name(self, name: str) -> str:
        if (match := _HF.match(name)) and match.group(2) in self._layer_from_hf:
            return f"layers.{match.group(1)}.{self._layer_from_hf[match.group(2)]}"
        if name in self._top_from_hf:
            return self._top_from_hf[name]
        raise KeyError(f"unexpected Hugging Face weight '{name}' for a {self.family} model")

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {self._hf_name(name): self.tensor_to_hf(name, t) for name, t in state.items()}
        if self.args.tie_embeddings:
            # Released tied checkpoints store only the embedding; safetensors also refuses shared storage.
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in state.items():
            ours = self._our_name(name)
            out[ours] = self.tensor_from_hf(ours, tensor)
        if "tok_embeddings.weight" in out:
            if "output.weight" not in out:
                out["output.weight"] = out["tok_embeddings.weight"]  # a tied file stores the table once
            elif self.args.tie_embeddings and not torch.equal(out["output.weight"], out["tok_embeddings.weight"]):
                # One table serves both ends; an lm_head stored anyway (some exports do) must agree with it.
                raise ValueError("the flavor ties embeddings but the file's lm_head.weight differs from "
                                 "model.embed_tokens.weight")
        return out
