"""Decoder weights to and from Hugging Face transformers' *ForCausalLM naming, shared by the families.

A family adds its own per-layer names and, where its tensors are laid out differently from the
Hugging Face ones, a conversion per tensor.
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


class DecoderStateDictAdapter:
    """Renames every tensor; subclasses set ``family`` and ``extra_layer_names`` and may convert tensors."""

    family: ClassVar[str] = "decoder"
    extra_layer_names: ClassVar[dict[str, str]] = {}

    def __init__(self, args):
        self.args = args
        self._layer_to_hf = {**DECODER_LAYER_NAMES, **self.extra_layer_names}
        self._layer_from_hf = {hf: ours for ours, hf in self._layer_to_hf.items()}
        self._top_from_hf = {hf: ours for ours, hf in DECODER_TOP_NAMES.items()}

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our tensor ``name`` in the Hugging Face layout (the same by default)."""
        return tensor

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The Hugging Face tensor for our ``name`` in our layout (the same by default)."""
        return tensor

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
