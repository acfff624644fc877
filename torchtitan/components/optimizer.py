"""Build the optimizer from the [optimizer] section."""

import torch
from torch import nn

from torchtitan.config.job_config import Optimizer as OptimizerConfig


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """One AdamW/Adam over the parameters of every model part (several with pipeline parallelism)."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    impl = {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }[cfg.implementation]
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return cls(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **impl
    )
