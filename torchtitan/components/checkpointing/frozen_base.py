"""The frozen base of a fine-tuning run (LoRA without lora.train_base): checkpoints leave it out and keep a
fingerprint of it instead.

A frozen weight never changes, so saving it at every step would only copy the base model again; resuming
loads it from checkpoint.initial_load_path (or, without one, from the same seeded initialisation) and the
checkpoint's trained weights on top. Adapters trained on one base are meaningless on another, so each
checkpoint holds, per frozen weight, its sum and sum of squares (float64, the same under any layout), and a
resume whose base differs is refused naming the first weight that does.
"""

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpointing.storage import CheckpointError
from torchtitan.models.shared.seeded_init import canonical_name

# Relative difference allowed between a saved fingerprint and this run's: the sums are of the same values,
# added in another order under another layout.
_RTOL = 1e-9


def frozen_names(model_parts: list[nn.Module]) -> set[str]:
    """Canonical names of the parameters that get no gradient."""
    return {canonical_name(name) for part in model_parts for name, p in part.named_parameters()
            if not p.requires_grad}


class BaseFingerprint(Stateful):
    """Saved under "base": {weight name: (sum, sum of squares)} of every frozen weight this rank holds."""

    def __init__(self, model_parts: list[nn.Module], base_source: str):
        self.model_parts = model_parts
        self.base_source = base_source  # where the base comes from, for the refusal's message

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for part in self.model_parts:
            for name, p in part.named_parameters():
                if p.requires_grad:
                    continue
                x = p.detach().to(torch.float64)  # an NF4 weight: its dequantised values
                sums = [x.sum(), x.square().sum()]
                # A DTensor's sum is partial over the ranks it is sharded on; full_tensor adds them up.
                sums = [s.full_tensor() if isinstance(s, DTensor) else s for s in sums]
                state[canonical_name(name)] = torch.stack(sums).cpu()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        ours = self.state_dict()
        for name, saved in state.items():
            if not torch.allclose(ours[name], saved, rtol=_RTOL, atol=0):
                raise CheckpointError(
                    f"the checkpoint's adapters were trained on another base model: its {name} has sum "
                    f"{saved[0].item():.6g} where this run's ({self.base_source}) has {ours[name][0].item():.6g}; "
                    "use the checkpoint.initial_load_path the run started from (the run's config.toml records it)")

    def refusal(self, metadata) -> str | None:
        """A one-line reason when the checkpoint was saved with another set of frozen weights, else None."""
        saved = {name.split(".", 1)[1] for name in metadata.state_dict_metadata if name.startswith("base.")}
        ours = frozen_names(self.model_parts)
        if saved and ours - saved:
            return (f"its base fingerprint covers no {min(ours - saved)}, a frozen weight of this run: it "
                    "was saved with other lora.targets or lora.train_base")
        return None
