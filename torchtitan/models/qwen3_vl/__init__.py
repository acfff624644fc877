"""Qwen3-VL, registered as model.name = "qwen3_vl": Qwen3's decoder with the shared vision tower and M-RoPE."""

from torchtitan.models.qwen3_vl.args import Qwen3VLModelArgs, qwen3_vl_flavors
from torchtitan.models.qwen3_vl.model import Qwen3VL
from torchtitan.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("qwen3_vl", decoder_train_spec(qwen3_vl_flavors, Qwen3VLStateDictAdapter, model_cls=Qwen3VL))

__all__ = ["Qwen3VL", "Qwen3VLModelArgs", "Qwen3VLStateDictAdapter", "qwen3_vl_flavors"]
