"""The TrainSpec of a family built on the shared decoder: only its flavors and Hugging Face adapter differ."""

from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.protocols.tensor_parallel_plan import BlockPlan
from torchtitan.protocols.train_spec import TrainSpec


def decoder_train_spec(flavors: dict[str, DecoderArgs], state_dict_adapter: type | None = None,
                       model_cls: type[Decoder] = Decoder, tp_block_plan: BlockPlan | None = None) -> TrainSpec:
    """The shared decoder (or a subclass with its own blocks) with every parallelism (TP with QK-norm, CP, AC,
    compile, FSDP/HSDP/DDP, PP), which the trainer applies to any Decoder; a family with its own attention gives
    its blocks' tensor-parallel plan as ``tp_block_plan`` (protocols/tensor_parallel_plan.py)."""
    return TrainSpec(model_cls=model_cls, flavors=flavors, state_dict_adapter=state_dict_adapter,
                     tp_block_plan=tp_block_plan)
