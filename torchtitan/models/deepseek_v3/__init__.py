"""DeepSeek-V3, registered as model.name = "deepseek_v3": the shared decoder with multi-head latent attention and
DeepSeek-V3's MoE (sigmoid group-limited routing, shared experts, dense first layers)."""

from torchtitan.models.deepseek_v3.args import DeepseekV3ModelArgs, deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import DeepseekV3Model, MultiHeadLatentAttention
from torchtitan.models.deepseek_v3.parallelize import deepseek_v3_block_plan
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("deepseek_v3", decoder_train_spec(deepseek_v3_flavors, DeepseekV3StateDictAdapter,
                                                      model_cls=DeepseekV3Model,
                                                      tp_block_plan=deepseek_v3_block_plan))

__all__ = ["DeepseekV3Model", "DeepseekV3ModelArgs", "DeepseekV3StateDictAdapter", "MultiHeadLatentAttention",
           "deepseek_v3_flavors"]
