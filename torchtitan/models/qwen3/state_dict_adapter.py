"""Qwen3 weights to and from Hugging Face transformers' Qwen3ForCausalLM naming.

Both sides rotate the two halves of each head in RoPE, so tensors map one to one by name only.
"""

from typing import ClassVar

from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.shared.decoder_state_dict_adapter import DecoderStateDictAdapter


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    family = "Qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    hf_model_type = "qwen3"
    extra_layer_names: ClassVar[dict[str, str]] = {
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    args: Qwen3ModelArgs

    def extra_hf_config(self) -> dict:
        return {"rope_scaling": None, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": self.args.n_layers}
