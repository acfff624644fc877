"""Build the optimizer from the [optimizer] section, and take its step on clipped gradients."""

import torch
from torch import nn

from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.grad_norm import clip_grads_, clip_scale
from torchtitan.hardware import DTYPES

# optimizer.implementation as PyTorch's optimizer flags.
KERNEL_FLAGS = {
    "fused": {"fused": True, "foreach": False},
    "foreach": {"fused": False, "foreach": True},
    "for-loop": {"fused": False, "foreach": False},
}


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """One optimizer over the parameters of every model part (several with pipeline parallelism): AdamW/Adam,
    Muon with AdamW for the parameters that are not hidden matrices (components/optimizers/muon.py), or AdamW with
    8-bit moments (components/optimizers/adamw_8bit.py)."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    state_dtype = None if cfg.state_dtype == "float32" else DTYPES[cfg.state_dtype]
    if cfg.name == "Muon":
        from torchtitan.components.optimizers.muon import build_muon
        from torchtitan.distributed.precision import resolve_compute_dtype

        ns_dtype = cfg.muon_ns_dtype
        if ns_dtype == "auto":
            ns_dtype = resolve_compute_dtype("auto", params[0].device.type if params else "cpu")[0]
        return build_muon(model_parts, cfg, KERNEL_FLAGS[cfg.implementation], DTYPES[ns_dtype], state_dtype)
    if cfg.name == "AdamW8bit":
        from torchtitan.components.optimizers.adamw_8bit import build_adamw_8bit

        return build_adamw_8bit(params, cfg)
    if state_dtype is not None:  # AdamW (config_check refuses Adam) keeping its moments in a lower precision
        from torchtitan.components.optimizers.muon import MuonWithAdamW

        return MuonWithAdamW([], params, cfg, KERNEL_FLAGS[cfg.implementation], ns_dtype=torch.float32,
                             state_dtype=state_dtype)
    impl = KERNEL_FLAGS[cfg.implementation]
    if cfg.name == "SGD":  # stateless: e.g. to check an algorithm against its definition (DiLoCo with H = 1)
        # DTensor has no sharding rule for the fused SGD kernel: "fused" runs the foreach one.
        impl = KERNEL_FLAGS["foreach" if cfg.implementation == "fused" else cfg.implementation]
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **impl)
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return cls(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **impl
    )


def state_bytes(cfg: OptimizerConfig, param_dtype: str, local_elements: float, muon: bool) -> float:
    """Bytes of optimizer state the built optimizer keeps for a parameter tensor of ``local_elements`` on the rank
    (``muon``: Muon updates it): AdamW's two moments in state_dtype (float32: the parameters' dtype), 8-bit ones
    where torchao quantises them, or Muon's one momentum buffer. The planner's figures (planner/memory.py)."""
    itemsize = DTYPES[param_dtype if cfg.state_dtype == "float32" else cfg.state_dtype].itemsize
    if cfg.name == "Muon" and muon:
        return local_elements * itemsize
    if cfg.name == "SGD":
        return 0
    if cfg.name == "AdamW8bit":
        from torchtitan.components.optimizers.adamw_8bit import moment_bytes

        quantized = moment_bytes(int(local_elements))
        if quantized is not None:
            return 2 * quantized
    return 2 * local_elements * itemsize


def clipped_step(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor], grad_norm: torch.Tensor,
                 max_norm: float) -> None:
    """The optimizer step on gradients clipped to a global norm of ``max_norm`` (no clipping when <= 0).

    A fused optimizer (PyTorch marks those whose kernels unscale gradients themselves, for AMP's GradScaler,
    with ``_step_supports_amp_scaling``) divides the gradients by the clip scale inside its own kernel, saving
    a separate read and write of every gradient; the others get the gradients divided in place first. For
    float32 gradients both give the same bits (each divides by the same float32 scale, correctly rounded); for
    bfloat16 ones the fused kernel keeps the quotient in float32, one rounding fewer.
    """
    scale = clip_scale(grad_norm, max_norm) if max_norm > 0 else None
    supports_scale = getattr(optimizer, "_step_supports_amp_scaling", False)
    in_kernel = supports_scale and scale is not None
    if in_kernel:
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        # The kernel reads the scale on the parameters' device. PyTorch would copy it there without waiting
        # (non_blocking): from a GPU into host memory (FSDP CPU offload) the CPU kernel could read it before it
        # lands. A blocking copy here; parameters on several devices are clipped first instead.
        in_kernel = len(devices) == 1
        if in_kernel:
            scale = scale.to(devices.pop())
    if supports_scale:
        optimizer.grad_scale = scale if in_kernel else None  # read by step(); None steps unscaled
    if scale is not None and not in_kernel:
        clip_grads_(parameters, scale)
    optimizer.step()
