"""Llama 3, registered as model.name = "llama3"."""

from torchtitan.models.llama3.args import Llama3ModelArgs, llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

register_train_spec(
    "llama3",
    TrainSpec(model_cls=Transformer, flavors=llama3_flavors, parallelize_fn=parallelize_llama),
)

__all__ = ["Llama3ModelArgs", "Transformer", "llama3_flavors", "parallelize_llama"]
