"""Llama 3 weights to and from Hugging Face transformers' LlamaForCausalLM naming.

Our RoPE rotates adjacent channel pairs, transformers' the two halves of each head: the shared adapter
permutes the q and k projection rows between the two.

From a config.json (models/shared/hf_config.py): any widths (the feed-forward's as hidden_dim), Llama 3.1 RoPE
scaling; refused: a head_dim other than hidden_size / num_attention_heads, biases, another activation or RoPE
scaling type.
"""

from typing import ClassVar

from torchtitan.models.llama3.args import Llama3ModelArgs, RopeScaling
from torchtitan.models.shared.decoder_state_dict_adapter import DecoderStateDictAdapter
from torchtitan.models.shared.hf_config import Default, derived, head_dim, heads


class Llama3StateDictAdapter(DecoderStateDictAdapter):
    family = "Llama"
    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"
    # transformers' LlamaConfig.
    hf_defaults: ClassVar[dict[str, Default]] = {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "num_key_value_heads": derived("num_key_value_heads", heads), "head_dim": derived("head_dim", head_dim),
    }
    args: Llama3ModelArgs

    def extra_hf_config(self) -> dict:
        scaling = self.args.rope_scaling
        if scaling is None:
            return {"mlp_bias": False}
        return {"mlp_bias": False, "rope_scaling": {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }}

    @classmethod
    def _args_from_hf_view(cls, view: dict) -> Llama3ModelArgs:
        scaling = None
        if view["rope_type"] == "llama3":
            names = [f"rope_parameters.{name}" for name in ("factor", "low_freq_factor", "high_freq_factor",
                                                             "original_max_position_embeddings")]
            if missing := [name for name in names if view[name] is None]:
                raise KeyError(missing[0])  # transformers requires each of them too
            scaling = RopeScaling(*(view[name] for name in names))
        return Llama3ModelArgs(**cls._decoder_fields(view), hidden_dim=view["intermediate_size"],
                               rope_scaling=scaling)
