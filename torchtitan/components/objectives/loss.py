"""The training loss: summed token cross-entropy, divided by the global count of valid tokens.

Dividing by the count over all micro-batches and all data-parallel ranks (not by each micro-batch's
own count) makes gradient accumulation, data, pipeline and context parallelism compute one loss.
"""

from typing import Callable

import torch
import torch.nn.functional as F

from torchtitan.data.dataset import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | float], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the per-token cross-entropy (fp32), skipping labels equal to IGNORE_INDEX."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def build_cross_entropy_loss(compile_loss: bool = False, backend: str = "inductor") -> LossFn:
    """loss(logits, labels, global_valid_tokens) -> this micro-batch's share of the global mean."""
    summed = torch.compile(cross_entropy_sum, backend=backend) if compile_loss else cross_entropy_sum

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, global_valid_tokens) -> torch.Tensor:
        return summed(logits, labels) / global_valid_tokens

    return loss_fn


def summed_loss_share(summed: torch.Tensor, labels: torch.Tensor, global_valid_tokens) -> torch.Tensor:
    """The LossFn for a model that returns its summed cross-entropy itself (training.loss_chunk_size)."""
    return summed / global_valid_tokens


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
