"""Qwen3 weights to and from Hugging Face transformers' Qwen3ForCausalLM naming.

Both sides rotate the two halves of each head in RoPE, so tensors map one to one by name only.

From a config.json (models/shared/hf_config.py): any widths and head_dim; refused: sliding-window layers, attention
biases, another activation, RoPE scaling.
"""

from typing import ClassVar

from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.shared.decoder_state_dict_adapter import DecoderStateDictAdapter
from torchtitan.models.shared.hf_config import Default, derived, heads

FULL, SLIDING = "full_attention", "sliding_attention"


class Qwen3StateDictAdapter(DecoderStateDictAdapter):
    family = "Qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    hf_model_type = "qwen3"
    extra_layer_names: ClassVar[dict[str, str]] = {
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    # transformers' Qwen3Config.
    hf_defaults: ClassVar[dict[str, Default]] = {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28,
        "num_key_value_heads": derived("num_key_value_heads", heads, absent=32),
    }
    args: Qwen3ModelArgs

    def extra_hf_config(self) -> dict:
        return {"rope_scaling": None, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": self.args.n_layers}

    @classmethod
    def _hf_view_of_family(cls, view: dict) -> dict:
        # A window applies only with use_sliding_window, to the layers layer_types marks (by default those from
        # max_window_layers on); what is left is the layer types in effect and the window where one slides.
        window = view.pop("sliding_window", None) if view.pop("use_sliding_window", False) else None
        first = view.pop("max_window_layers", 0)
        types = view.get("layer_types") or [SLIDING if window is not None and i >= first else FULL
                                            for i in range(view["num_hidden_layers"])]
        view["layer_types"] = [t if window is not None else FULL for t in types]
        view["sliding_window"] = window if SLIDING in view["layer_types"] else None
        return view

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> Qwen3ModelArgs:
        return Qwen3ModelArgs(**cls._decoder_fields(view), head_dim=view["head_dim"],
                              hidden_dim=view["intermediate_size"])
