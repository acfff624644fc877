"""Kimi Linear, registered as model.name = "kimi_linear": Kimi Delta Attention and NoPE multi-head latent attention
blocks, each with DeepSeek-V3's MoE."""

from torchtitan.models.kimi_linear.args import KimiLinearModelArgs, kimi_linear_flavors
from torchtitan.models.kimi_linear.model import KimiDeltaAttention, KimiLinearModel
from torchtitan.models.kimi_linear.parallelize import kimi_linear_block_plan
from torchtitan.models.kimi_linear.state_dict_adapter import KimiLinearStateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("kimi_linear", decoder_train_spec(kimi_linear_flavors, KimiLinearStateDictAdapter,
                                                      model_cls=KimiLinearModel, tp_block_plan=kimi_linear_block_plan))

__all__ = ["KimiDeltaAttention", "KimiLinearModel", "KimiLinearModelArgs", "KimiLinearStateDictAdapter",
           "kimi_linear_flavors"]
