"""Training objectives: what a step makes of a batch, how its targets are counted, and its loss.

The trainer's local step and the pipeline's last stage call the same objective, so a new one (distillation,
a z-loss, ...) is added by registering a builder in ``OBJECTIVES`` and naming it in ``training.objective``,
from a module of the user's own (``experimental.custom_import``), without touching the trainer.

For each micro-batch (whole rows on the device, before context parallelism shards them) ``prepare`` gives the
forward's keyword inputs beyond the tokens (e.g. multi-token prediction's tokens ahead) and one target tensor
(batch, ..., seq) the loss compares the output with: the pipeline hands it to the last stage, and context
parallelism shards the last dimension of both like the tokens. ``count(targets)`` is a vector of valid-target
counts, one per normalised term; the trainer sums it over the step's micro-batches and all ranks before the
first forward, so every term is a global mean whatever the layout (components/objectives/loss.py). ``loss`` returns the
micro-batch's share of the loss to backpropagate and a detached vector of parts: the next-token loss first
(logged as ``loss``), then one value per name of ``metric_names``; the trainer sums the parts over
micro-batches and ranks and logs them.

An objective that makes its own data (GRPO's rollouts of the policy being trained) has
``build_data_source(context: DataSourceContext)``: the trainer iterates what it returns instead of the dataset's
loader, checkpoints it as the dataloader, and logs its ``metrics()``.
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchtitan.components.objectives.loss import LossFn, count_valid_tokens
from torchtitan.components.objectives.multi_token_prediction import count_mtp_targets, mtp_loss, mtp_targets
from torchtitan.config.job_config import RL, Training
from torchtitan.data.dataset import Batch
from torchtitan.distributed.tensor_parallel import to_local_scalar
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.registry import Registry


@dataclass
class DataSourceContext:
    """What the trainer built that a data source of an objective's own may need."""

    cfg: Any  # the JobConfig
    tokenizer: Any
    model_parts: list  # the model being trained, parallelized
    build_model_part: Callable[[], Any]  # another model like it, parallelized alike, seeded-initialised
    build_local_model: Callable[[], Any]  # a whole model with the same converters, on this device, not parallelized
    parallel_dims: Any
    device: torch.device
    autocast: Callable[[], Any]  # the trainer's compute precision context
    loss_parallel: bool  # the logits stay sharded over the vocabulary (tensor parallelism)
    masking: Any  # DocumentMasking: the forward's inputs of a batch
    dp_rank: int
    dp_degree: int
    grad_accum_steps: int
    seed: int


def loss_parts(*values: torch.Tensor) -> torch.Tensor:
    """The detached parts vector of ``loss`` (plain tensors, also under loss parallelism)."""
    return torch.stack([to_local_scalar(v.detach()).float() for v in values])


class NextToken:
    """Mean cross-entropy of each position's next token over the step's valid labels."""

    metric_names: tuple[str, ...] = ()

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn

    def prepare(self, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {}, batch.labels

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return count_valid_tokens(targets).reshape(1)

    def loss(self, output: Any, targets: torch.Tensor,
             global_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.loss_fn(output, targets, global_counts[0])
        return loss, loss_parts(loss)


class NextTokenWithMTP(NextToken):
    """Next-token loss + ``weight`` x the mean over depths of each multi-token prediction depth's mean loss
    (components/objectives/multi_token_prediction.py); targets stack the labels and each depth's, (batch, 1 + depth, seq)."""

    metric_names = ("mtp/loss",)

    def __init__(self, loss_fn: LossFn, depth: int, weight: float, block_causal: bool):
        super().__init__(loss_fn)
        self.depth, self.weight, self.block_causal = depth, weight, block_causal

    def prepare(self, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = mtp_targets(batch, self.depth, self.block_causal)
        return inputs, torch.cat([batch.labels[:, None], inputs["mtp_labels"]], dim=1)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.cat([count_valid_tokens(targets[:, 0]).reshape(1), count_mtp_targets(targets[:, 1:])])

    def loss(self, output: Any, targets: torch.Tensor,
             global_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, *predictions = output
        main = self.loss_fn(logits, targets[:, 0], global_counts[0])
        extra = mtp_loss(self.loss_fn, predictions, targets[:, 1:], global_counts[1:])
        return main + self.weight * extra, loss_parts(main, extra)


ObjectiveBuilder = Callable[..., Any]
"""``builder(loss_fn=, model_args=, training=, block_causal=, rl=)`` -> an objective (NextToken's methods); a builder
takes what it needs and ``**_`` for the rest."""

# GRPO registers itself from the RL room (which imports this module), loaded on the first lookup.
OBJECTIVES: Registry[ObjectiveBuilder] = Registry("training objective", ("torchtitan.rl.objective",))


def _next_token(loss_fn: LossFn, model_args: BaseModelArgs, training: Training, block_causal: bool,
                **_) -> NextToken:
    # A model with multi-token prediction blocks trains them alongside (model.mtp_depth).
    if model_args.builds_mtp_blocks and model_args.mtp_depth:
        return NextTokenWithMTP(loss_fn, model_args.mtp_depth, training.mtp_loss_weight, block_causal)
    return NextToken(loss_fn)


OBJECTIVES.register("next_token", _next_token)


def build_objective(training: Training, loss_fn: LossFn, model_args: BaseModelArgs, block_causal: bool,
                    rl: RL | None = None):
    """The objective ``training.objective`` names."""
    return OBJECTIVES.get(training.objective)(loss_fn=loss_fn, model_args=model_args, training=training,
                                              block_causal=block_causal, rl=rl if rl is not None else RL())


def config_problems(training: Training) -> list[tuple[str, str]]:
    """(field of [training], reason) for the objective as configured (after custom modules are imported)."""
    if training.objective not in OBJECTIVES:
        return [("objective", f"names no registered training objective; registered: {', '.join(OBJECTIVES.names())} "
                              "(a module named in experimental.custom_import can register one in "
                              "torchtitan.components.objectives.objective.OBJECTIVES)")]
    if training.loss_chunk_size > 0 and training.objective != "next_token":
        # The chunked head computes next-token cross-entropy against the batch's labels itself: another
        # objective would get a summed loss instead of logits, and its own targets would be ignored.
        return [("loss_chunk_size", f"computes the next-token loss inside the output head, which only the "
                                    f"next_token objective uses; set it to 0 with training.objective = "
                                    f"{training.objective!r}")]
    return []
