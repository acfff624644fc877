"""Llama 3, registered as model.name = "llama3"."""

from torchtitan.distributed.pipeline_parallel import build_pipeline
from torchtitan.models.llama3.args import Llama3ModelArgs, llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

register_train_spec(
    "llama3",
    TrainSpec(
        model_cls=Transformer,
        flavors=llama3_flavors,
        parallelize_fn=parallelize_llama,
        pipelining_fn=build_pipeline,
        state_dict_adapter=Llama3StateDictAdapter,
    ),
)

__all__ = ["Llama3ModelArgs", "Llama3StateDictAdapter", "Transformer", "llama3_flavors", "parallelize_llama"]
