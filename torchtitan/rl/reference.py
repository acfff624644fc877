"""The frozen reference model of GRPO's KL penalty (rl.kl_coeff > 0): the policy as training started.

- With LoRA adapters the reference is the policy with its adapters switched off: the frozen base, no copy.
- Otherwise a second model built and parallelized like the policy (the same layout: its forward is sharded the same
  way), with no optimizer state and no gradients. At the run's start it copies the policy's weights once they are
  loaded (checkpoint.initial_load_path, a Hugging Face folder, or the seeded initialisation), and the run's checkpoints
  hold it (state key "reference"), so a resumed run scores against the same weights.

Its log-probabilities of the rollouts are computed once per batch, before the update, under the same sampling
distribution as the policy's (objectives/grpo.py's ``token_logprobs``).
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.objectives.grpo import RolloutBatch, token_logprobs
from torchtitan.distributed.tensor_parallel import loss_parallel_context
from torchtitan.generation.sampling import SamplingConfig
from torchtitan.models.shared.lora import adapters_off, is_adapted
from torchtitan.models.shared.moe import load_statistics_kept


class ReferenceModel(Stateful):
    def __init__(self, policy: nn.Module, build_model_part: Callable[[], nn.Module], sampling: SamplingConfig,
                 model_inputs: Callable[[RolloutBatch], dict], autocast: Callable[[], AbstractContextManager],
                 loss_parallel: bool):
        self.policy, self.sampling, self.model_inputs = policy, sampling, model_inputs
        self.autocast, self.loss_parallel = autocast, loss_parallel
        self.lora = any(is_adapted(m) for m in policy.modules())
        self.model: nn.Module | None = None
        self.loaded = False  # from a checkpoint; else copied from the policy at first use
        if not self.lora:
            self.model = build_model_part()
            self.model.requires_grad_(False)

    @property
    def source(self) -> str:
        return "the policy's base with its LoRA adapters off" if self.lora else "a frozen copy of the starting policy"

    def state_dict(self) -> dict:
        return {} if self.model is None else self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.model is not None:
            self.model.load_state_dict(state)
            self.loaded = True

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) log-probabilities of the batch's labels under the reference (0 where no label)."""
        if self.model is not None and not self.loaded:
            self.model.load_state_dict(self.policy.state_dict())  # the same layout: each rank copies its shards
            self.loaded = True
        model = self.model if self.model is not None else self.policy
        off = adapters_off(model) if self.lora else nullcontext()
        with off, load_statistics_kept(model), self.autocast():
            logits = model(batch.input_ids, **self.model_inputs(batch))
            with loss_parallel_context(self.loss_parallel):
                return token_logprobs(logits, batch.labels, self.sampling)
