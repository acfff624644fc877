"""gpt-oss, registered as model.name = "gpt_oss": the shared decoder with attention sinks, alternating
sliding-window and full attention, and the shared MoE with biases and the clamped SwiGLU."""

from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_flavors
from torchtitan.models.gpt_oss.model import GptOssModel, SinkAttention
from torchtitan.models.gpt_oss.parallelize import gpt_oss_block_plan
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from torchtitan.models.shared.decoder_spec import decoder_train_spec
from torchtitan.protocols.train_spec import register_train_spec

register_train_spec("gpt_oss", decoder_train_spec(gpt_oss_flavors, GptOssStateDictAdapter, model_cls=GptOssModel,
                                                  tp_block_plan=gpt_oss_block_plan))

__all__ = ["GptOssModel", "GptOssModelArgs", "GptOssStateDictAdapter", "SinkAttention", "gpt_oss_flavors"]
