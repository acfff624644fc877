"""Qwen3-MoE, registered as model.name = "qwen3_moe": the shared decoder with Qwen3's attention and a
Mixture-of-Experts feed-forward in every block."""

from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs, qwen3_moe_flavors
from torchtitan.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("qwen3_moe", decoder_train_spec(qwen3_moe_flavors, Qwen3MoeStateDictAdapter))

__all__ = ["Qwen3MoeModelArgs", "Qwen3MoeStateDictAdapter", "qwen3_moe_flavors"]
