"""A training objective registered from outside the package (through experimental.custom_import): next-token
cross-entropy plus a z-loss, COEFF x the mean over valid tokens of logsumexp(logits)^2, which keeps the
softmax normaliser near 1 (as PaLM trained with, coefficient 1e-4; a large one here, so it moves the numbers).

``loss`` is logged as the cross-entropy alone and the z-term as ``z_loss``; both are normalised by the step's
global count of valid tokens, like every loss term.
"""

import torch

from torchtitan.components.objectives.objective import OBJECTIVES, NextToken, loss_parts
from torchtitan.data.dataset import IGNORE_INDEX

COEFF = 0.05


class NextTokenZLoss(NextToken):
    metric_names = ("z_loss",)

    def loss(self, output, targets, global_counts):
        ce = self.loss_fn(output, targets, global_counts[0])
        valid = (targets != IGNORE_INDEX).flatten()
        lse = torch.logsumexp(output.flatten(0, -2).float(), dim=-1)[valid]
        z = (lse**2).sum() / global_counts[0]
        return ce + COEFF * z, loss_parts(ce, z)


def _build(loss_fn, model_args, training, block_causal, **_):
    return NextTokenZLoss(loss_fn)


if "next_token_z_loss" not in OBJECTIVES:
    OBJECTIVES.register("next_token_z_loss", _build)
