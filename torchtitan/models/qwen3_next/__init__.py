"""Qwen3-Next, registered as model.name = "qwen3_next": the shared decoder with Gated DeltaNet and gated-attention
blocks, each with the shared MoE (a sigmoid-gated shared expert)."""

from torchtitan.models.qwen3_next.args import Qwen3NextModelArgs, qwen3_next_flavors
from torchtitan.models.qwen3_next.model import GatedAttention, Qwen3NextModel
from torchtitan.models.qwen3_next.parallelize import qwen3_next_block_plan
from torchtitan.models.qwen3_next.state_dict_adapter import Qwen3NextStateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("qwen3_next", decoder_train_spec(qwen3_next_flavors, Qwen3NextStateDictAdapter,
                                                     model_cls=Qwen3NextModel, tp_block_plan=qwen3_next_block_plan))

__all__ = ["GatedAttention", "Qwen3NextModel", "Qwen3NextModelArgs", "Qwen3NextStateDictAdapter",
           "qwen3_next_flavors"]
