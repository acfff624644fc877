"""Qwen3 (dense), registered as model.name = "qwen3": the shared decoder with Qwen3's args and HF names.

Built only from the public extension API (DecoderArgs, the decoder's TrainSpec and the HF adapter base),
the way a family outside this repository would be.
"""

from torchtitan.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("qwen3", decoder_train_spec(qwen3_flavors, Qwen3StateDictAdapter))

__all__ = ["Qwen3ModelArgs", "Qwen3StateDictAdapter", "qwen3_flavors"]
