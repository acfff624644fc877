"""The TrainSpec of a family built on the shared decoder: only its flavors and Hugging Face adapter differ."""

from torchtitan.distributed.apply_common import parallelize_decoder
from torchtitan.distributed.pipeline_parallel import build_pipeline
from torchtitan.models.decoder import Decoder
from torchtitan.models.decoder_args import DecoderArgs
from torchtitan.protocols.train_spec import TrainSpec


def decoder_train_spec(flavors: dict[str, DecoderArgs], state_dict_adapter: type | None = None) -> TrainSpec:
    """The shared decoder with every parallelism (TP with QK-norm, CP, AC, compile, FSDP/HSDP/DDP, PP)."""
    return TrainSpec(model_cls=Decoder, flavors=flavors, parallelize_fn=parallelize_decoder,
                     pipelining_fn=build_pipeline, state_dict_adapter=state_dict_adapter)
