"""µP's learning rates: each parameter's lr is optimizer.lr times a multiplier that depends on the width.

With r = base_width / dim (models/shared/mup.py has the model's side: init, logits, attention scale):

- AdamW, Adam and AdamW8bit: hidden matrices r, everything else (embeddings, the output head, whose logits µP
  already scales by r, norms, biases) 1. Adam's update has a fixed size per entry, so a matrix's effect on its
  output grows with its fan_in; r undoes that.
- Muon (its matrices; the parameters its AdamW group updates follow the AdamW rule): Muon's update is orthogonal,
  of spectral norm 1 before its lr adjustment. µP asks for a spectral norm of sqrt(fan_out / fan_in) (Yang,
  Simon and Bernstein, "A spectral condition for feature learning"): muon_adjust_lr = "original" scales it by
  sqrt(max(1, rows / cols)), which already is that, so the multiplier is 1; "match_rms_adamw" scales it by
  0.2 * sqrt(max(rows, cols)), which grows as sqrt(width), so the multiplier is sqrt(r).

Each optimizer's parameter groups are split by multiplier after it is built (a group's lr is its multiplier
times the schedule's lr; ``lr_multiplier`` in the group says which); at the base width every multiplier is 1 and
the optimizer is left as built.
"""

import math

import torch
from torch import nn

from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.config.job_config import Model as ModelConfig
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.models.shared.decoder_args import DecoderArgs
from torchtitan.models.shared.mup import MupArgs, hidden_matrices

# The optimizers µP's multipliers are derived for here (SGD's differ: its hidden matrices keep lr, and the
# embeddings' and the output's change instead).
SUPPORTED = ("AdamW", "Adam", "AdamW8bit", "Muon")


def config_problems(model: ModelConfig, optimizer: OptimizerConfig, checkpoint: CheckpointConfig,
                    args: DecoderArgs | None) -> list[tuple[str, str]]:
    """Problems with [model.mup] given the other sections and the model's args (None where they could not be
    built), as (field, reason) pairs (model_config_problems checks the section itself against the model)."""
    if not model.mup.base_width:
        return []
    problems = []
    for field, used in (("initial_load_in_hf", checkpoint.initial_load_in_hf),
                        ("last_save_in_hf", checkpoint.last_save_in_hf)):
        if used and args is not None and args.mup_changes_outputs:
            problems.append((f"checkpoint.{field}", "cannot be used with µP away from the base width "
                                                    "(model.mup): a Hugging Face model has no µP multipliers"))
    if optimizer.name not in SUPPORTED:
        problems.append(("model.mup.base_width", f"has learning-rate multipliers for {', '.join(SUPPORTED)}, not "
                                                 f"optimizer.name = {optimizer.name!r}"))
    if "lora" in model.converters:
        problems.append(("model.mup.base_width", "parametrizes pretraining from scratch; it does not combine with "
                                                 "the lora converter (fine-tuning a trained model)"))
    return problems


def lr_multipliers(model_parts: list[nn.Module], mup: MupArgs, dim: int, cfg: OptimizerConfig
                   ) -> dict[torch.Tensor, float]:
    """Each trainable parameter's lr multiplier (see the module doc)."""
    r = mup.width_ratio(dim)
    muon = set()
    if cfg.name == "Muon":
        from torchtitan.components.optimizers.muon import split_parameters

        muon = {param for _, param in split_parameters(model_parts)[0]}
    muon_multiplier = 1.0 if cfg.muon_adjust_lr == "original" else math.sqrt(r)
    multipliers = {}
    for part in model_parts:
        hidden = hidden_matrices(part)
        for name, param in part.named_parameters():
            if param.requires_grad:
                multipliers[param] = muon_multiplier if param in muon else r if name in hidden else 1.0
    return multipliers


def apply_lr_multipliers(optimizer: torch.optim.Optimizer, multipliers: dict[torch.Tensor, float]) -> None:
    """Split the optimizer's groups (before an lr scheduler reads them) into one group per multiplier."""
    if all(m == 1.0 for m in multipliers.values()):
        return
    groups = []
    for group in optimizer.param_groups:
        by_multiplier: dict[float, list] = {}
        for param in group["params"]:
            by_multiplier.setdefault(multipliers.get(param, 1.0), []).append(param)
        # Muon orthogonalises its group's matrices together (their owner plan): they share one multiplier.
        assert group.get("kind") != "muon" or len(by_multiplier) == 1, "Muon's matrices need one lr multiplier"
        groups += [{**group, "params": params, "lr": group["lr"] * m, "lr_multiplier": m}
                   for m, params in by_multiplier.items()]
    optimizer.param_groups = groups


def base_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """The schedule's lr (optimizer.lr's share of it) from the first group's ``lr``, whatever its multiplier."""
    return lr / optimizer.param_groups[0].get("lr_multiplier", 1.0)
