"""Llama 3 weights to and from Hugging Face transformers' LlamaForCausalLM naming.

Our RoPE rotates adjacent channel pairs, transformers' the two halves of each head: the shared adapter
permutes the q and k projection rows between the two.
"""

from torchtitan.models.llama3.args import Llama3ModelArgs
from torchtitan.models.shared.decoder_state_dict_adapter import DecoderStateDictAdapter


class Llama3StateDictAdapter(DecoderStateDictAdapter):
    family = "Llama"
    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"
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
