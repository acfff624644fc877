"""The TrainSpec of a family built on the shared decoder: only its flavors and Hugging Face adapter differ."""

from torchtitan.distributed.apply_common import parallelize_decoder
from torchtitan.distributed.pipeline_parallel import build_pipeline
from torchtitan.models.decoder import Decoder
from torchtitan.models.decoder_args import DecoderArgs
from torchtitan.protocols.train_spec import TrainSpec


def decoder_train_spec(flavors: dict[str, DecoderArgs], state_dict_adapter: type | None = None,
                       model_cls: type[Decoder] = Decoder, parallelize_fn=parallelize_decoder) -> TrainSpec:
    """The shared decoder (or a subclass with its own blocks) with every parallelism (TP with QK-norm, CP, AC,
    compile, FSDP/HSDP/DDP, PP); a family with its own attention passes parallelize_decoder with its attention
    plan as ``parallelize_fn``."""
    return TrainSpec(model_cls=model_cls, flavors=flavors, parallelize_fn=parallelize_fn,
                     pipelining_fn=build_pipeline, state_dict_adapter=state_dict_adapter)
