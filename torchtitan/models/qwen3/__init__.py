"""Qwen3 (dense), registered as model.name = "qwen3".

Built only from the public extension API (TrainSpec, BaseModelArgs and the shared attention,
initialisation and distributed helpers), the way a family outside this repository would be.
"""

from torchtitan.distributed.pipeline_parallel import build_pipeline
from torchtitan.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

register_train_spec(
    "qwen3",
    TrainSpec(
        model_cls=Qwen3Model,
        flavors=qwen3_flavors,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=build_pipeline,
        state_dict_adapter=Qwen3StateDictAdapter,
    ),
)

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "Qwen3StateDictAdapter", "parallelize_qwen3", "qwen3_flavors"]
