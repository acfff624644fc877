"""One micro-batch's forward and backward, with or without pipeline parallelism, behind one signature.

``forward_backward(tokens, inputs, targets, global_counts, last_microbatch)`` runs the model on ``tokens``
(with ``inputs`` as keyword arguments), scores its output with the objective (components/objectives/objective.py) and
backpropagates; it returns this rank's loss parts (zeros on a pipeline rank without the last stage), which the
trainer sums over micro-batches and ranks. After the step's last backward, ``finish_gradients()`` completes
what the layout leaves unsummed and returns the parameters the gradient norm must not count twice. The
trainer's step is then the same for both.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from torchtitan.components.objectives.loss import LossFn
from torchtitan.distributed.data_parallel import set_gradient_sync
from torchtitan.distributed.pipeline_parallel import Pipeline
from torchtitan.distributed.tensor_parallel import loss_parallel_context


class LocalForwardBackward:
    """The whole model (one part) on this rank."""

    def __init__(self, model: nn.Module, objective: Any, autocast: Callable[[], AbstractContextManager],
                 loss_parallel: bool):
        self.model, self.objective = model, objective
        self.autocast, self.loss_parallel = autocast, loss_parallel

    def forward_backward(self, tokens: torch.Tensor, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                         global_counts: torch.Tensor, last_microbatch: bool) -> torch.Tensor:
        set_gradient_sync([self.model], last_microbatch)
        with self.autocast():
            output = self.model(tokens, **inputs)
        with loss_parallel_context(self.loss_parallel):
            loss, parts = self.objective.loss(output, targets, global_counts)
            del output  # the largest activation; free it before backward allocates gradients
            loss.backward()
        return parts

    def finish_gradients(self) -> list[torch.Tensor]:
        return []


class PipelineForwardBackward:
    """This rank's pipeline stages; the schedule calls ``stage_loss`` on the last stage (its ``loss_fn``),
    which scores with the objective and keeps the parts of each pipeline micro-batch.

    Validation runs the schedule without ``global_counts``: ``stage_loss`` then returns ``eval_loss_fn``'s
    summed next-token loss (divided by 1), as a validator expects.
    """

    def __init__(self, objective: Any, eval_loss_fn: LossFn, autocast: Callable[[], AbstractContextManager],
                 loss_parallel: bool, device: torch.device):
        self.objective, self.eval_loss_fn = objective, eval_loss_fn
        self.autocast, self.loss_parallel, self.device = autocast, loss_parallel, device
        self.pipeline: Pipeline | None = None  # set once built: the schedule is made with stage_loss
        self._parts: list[torch.Tensor] = []

    def stage_loss(self, output: Any, target: torch.Tensor, global_counts: torch.Tensor | None = None) -> torch.Tensor:
        if global_counts is None:
            return self.eval_loss_fn(output, target, 1.0)
        loss, parts = self.objective.loss(output, target, global_counts)
        self._parts.append(parts)
        return loss

    def forward_backward(self, tokens: torch.Tensor, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                         global_counts: torch.Tensor, last_microbatch: bool) -> torch.Tensor:
        # The pipeline stages sync their gradients themselves at the end of every schedule step.
        pipe = self.pipeline
        losses = [] if pipe.has_last_stage else None
        self._parts = []
        with self.autocast(), loss_parallel_context(self.loss_parallel):
            pipe.schedule.step(*((tokens,) if pipe.has_first_stage else ()),
                               target=targets if pipe.has_last_stage else None, losses=losses,
                               loss_kwargs={"global_counts": global_counts}, return_outputs=False, **inputs)
        if not losses:
            return torch.zeros(1 + len(self.objective.metric_names), device=self.device)
        # The schedule may also call the loss while it sets its stages up (first step): only the last
        # len(losses) calls are the micro-batches'.
        return torch.stack(self._parts[-len(losses):]).sum(0)

    def finish_gradients(self) -> list[torch.Tensor]:
        """Sum the gradients of the embedding's copies on the first and last stages (tied embeddings,
        multi-token prediction); the last stage's copy is then counted elsewhere by the norm."""
        shared = self.pipeline.shared_embedding
        if shared is None:
            return []
        shared.sum_gradients()
        return shared.counted_elsewhere
