"""AdamW with 8-bit moments (optimizer.name = "AdamW8bit"): torchao's AdamW8bit, made to take our lr schedule and
to checkpoint exactly and across layouts.

torchao quantises each moment block-wise (blocks of 256 values, one float32 scale per block, a 256-entry dynamic
code map per tensor) when the tensor on this rank (its local shard) has at least 4096 values and a whole number
of blocks; other tensors (norms, biases, small or uneven shards) keep their moments in the parameter's dtype. Its
step runs in float32 and is torch.compiled once per parameter shape. The planner counts the same rule
(moment_bytes).

Checkpoints hold the moments dequantised to float32, so DCP saves and reshards them like any optimizer state
(and AdamW's float32 moments load too). Loading quantises them again on the loading rank's blocks. Where a block
holds the values it was saved from (the layout is unchanged), the codes and the scale that reproduce them exactly
are recovered, so a resumed run is bitwise the uninterrupted one. Where it does not (another layout), torchao's
own quantisation applies, and each moment moves by up to half of its new block's quantisation step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Optimizer as OptimizerConfig

# torchao's rule for which moments it quantises (torchao/optim/adam.py: _new_buffer), per local tensor.
MIN_QUANTIZED_NUMEL = 4096
BLOCK_SIZE = 256


def moment_bytes(local_elements: int) -> float | None:
    """Bytes of one moment of a tensor with this many elements on the rank, or None where torchao keeps it
    unquantised: a byte per code, a float32 scale per block, the 256-entry float32 code map."""
    if local_elements < MIN_QUANTIZED_NUMEL or local_elements % BLOCK_SIZE:
        return None
    return local_elements + 4 * local_elements / BLOCK_SIZE + 4 * 256


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _is_quantized(value) -> bool:
    local = _local(value)
    return hasattr(local, "qmap") and hasattr(local, "codes")


def _dequantized(value):
    """An 8-bit moment (possibly inside a DTensor) as a float32 tensor of the same placement; others as they are."""
    if not _is_quantized(value):
        return value
    plain = _local(value).dequantize(torch.float32)
    if isinstance(value, DTensor):
        return DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return plain


def requantize_(state, values: torch.Tensor) -> None:
    """Set an 8-bit moment (torchao's OptimState8bit) to ``values``: per block, the codes and scale that dequantise
    to exactly these values when there are any (values saved from the same blocks), else torchao's quantisation.

    The block's scale is its largest value, or its most negative one over the code map's most negative entry
    (the signed map ends at -0.99297, not -1), whichever is larger; a float32 division may land that one unit in
    the last place off, so its neighbours are tried too.
    """
    from torchao.optim.quant_utils import dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor

    blocks = values.detach().float().reshape(-1, state.block_size)
    qmap = state.qmap
    recovered = blocks.amax(-1)
    if state.signed:
        recovered = torch.maximum(recovered, blocks.amin(-1) / qmap[0])
    recovered = recovered.clip(1e-12)
    scaled, absmax = scale_tensor(blocks, state.block_size)  # torchao's: the block's largest magnitude
    codes, scale = quantize_8bit_with_qmap(scaled, qmap), absmax
    for candidate in (torch.nextafter(recovered, torch.zeros_like(recovered)),
                      torch.nextafter(recovered, torch.full_like(recovered, torch.inf)), recovered):
        trial = quantize_8bit_with_qmap(blocks / candidate[:, None], qmap)
        exact = (dequant_with_qmap(trial, qmap, candidate) == blocks).all(-1)
        codes = torch.where(exact[:, None], trial, codes)
        scale = torch.where(exact, candidate, scale)
    state.codes.copy_(codes.view(state.codes.shape))
    state.scale.copy_(scale)


class AdamW8bitCheckpointable:
    """Float lrs from the scheduler's checkpoint, and float32 moments in and out of state_dict."""

    def step(self, closure=None):
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):  # torchao reads the lr as a tensor
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
        return super().step(closure)

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["state"] = {key: {name: _dequantized(value) for name, value in entry.items()}
                          for key, entry in saved["state"].items()}
        for group in saved["param_groups"]:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"] = group["lr"].item()
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    if not (state and key in state):
                        continue
                    buffer = self._new_buffer(param, signed)  # quantised or not by torchao's rule
                    if _is_quantized(buffer):
                        requantize_(_local(buffer), _local(state[key]))
                    else:
                        buffer.copy_(state[key])
                    state[key] = buffer


def build_adamw_8bit(params: list[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    import torchao.optim

    cls = type("AdamW8bit", (AdamW8bitCheckpointable, torchao.optim.AdamW8bit), {"__module__": __name__})
    return cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
               block_size=BLOCK_SIZE)
