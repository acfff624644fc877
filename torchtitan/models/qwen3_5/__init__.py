"""Qwen3.5, registered as model.name = "qwen3_5": Qwen3-Next's hybrid decoder (dense, or MoE in the *_moe and
35B-A3B flavors) with the shared vision tower and M-RoPE."""

from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs, qwen3_5_flavors
from torchtitan.models.qwen3_5.model import Qwen3_5
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5MoeStateDictAdapter, Qwen3_5StateDictAdapter
from torchtitan.models.qwen3_next.parallelize import qwen3_next_block_plan
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("qwen3_5", decoder_train_spec(qwen3_5_flavors, Qwen3_5StateDictAdapter, model_cls=Qwen3_5,
                                                  tp_block_plan=qwen3_next_block_plan))

__all__ = ["Qwen3_5", "Qwen3_5ModelArgs", "Qwen3_5MoeStateDictAdapter", "Qwen3_5StateDictAdapter", "qwen3_5_flavors"]
