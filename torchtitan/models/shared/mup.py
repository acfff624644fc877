"""µP (the maximal update parametrization, Yang et al., Tensor Programs V): what changes in the model.

A model of width ``dim`` is described relative to a base model of width ``base_width`` (and attention head size
``base_head_dim``), the one the hyper-parameters were tuned on; with r = base_width / dim:

- hidden matrices (every weight matrix whose input size grows with the width: attention, feed-forward, experts,
  routers) start from the standard init's std times sqrt(r), i.e. a variance proportional to 1 / fan_in;
- the logits are multiplied by r (the output head's input is scaled before the projection), so they stay of the
  same size as the width grows although the head's fan_in does;
- attention scores are q.k * sqrt(base_head_dim) / head_dim instead of q.k / sqrt(head_dim): once training has
  aligned q and k, their dot product grows with head_dim, not with its square root;
- embeddings, norms and biases keep the standard init.

The optimizer's side, the learning rate of each parameter group, is in components/optimizers/mup.py. At the base width
(r = 1, head_dim = base_head_dim) every factor is 1 and is not applied: the model is the standard one, bit for bit.
"""

import math
from dataclasses import dataclass

from torch import nn

from torchtitan.models.shared.gated_deltanet import ShortConv
from torchtitan.models.shared.moe import GroupedExperts


@dataclass(frozen=True)
class MupArgs:
    base_width: int
    """The width (dim) of the base model the hyper-parameters were tuned on."""
    base_head_dim: int
    """The base model's attention head size."""

    def width_ratio(self, dim: int) -> float:
        """r = base_width / dim: the output multiplier, and the hidden matrices' learning-rate factor under AdamW."""
        return self.base_width / dim

    def attention_scale(self, head_dim: int) -> float | None:
        """sqrt(base_head_dim) / head_dim; None (the kernels' default 1/sqrt(head_dim)) at the base head size."""
        return None if head_dim == self.base_head_dim else math.sqrt(self.base_head_dim) / head_dim


def hidden_matrices(model: nn.Module) -> set[str]:
    """The names (as ``model.named_parameters`` gives them) of the hidden matrices: parameters of two or more
    dimensions other than the embedding tables, the output head, depthwise conv filters (one row of taps per
    channel) and the experts' stacked biases."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, ShortConv)) or module_name == "output":
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.ndim >= 2 and not (isinstance(module, GroupedExperts) and name in ("b1", "b2", "b3")):
                names.add(f"{module_name}.{name}" if module_name else name)
    return names
