"""Llama 3, registered as model.name = "llama3": the shared decoder with Llama's args and HF names."""

from torchtitan.models.llama3.args import Llama3ModelArgs, llama3_flavors
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("llama3", decoder_train_spec(llama3_flavors, Llama3StateDictAdapter))

__all__ = ["Llama3ModelArgs", "Llama3StateDictAdapter", "llama3_flavors"]
