"""What generates the rollouts: the ``Sampler`` interface, its registry (``rl.sampler``), and the built-in one, the
generation engine on a whole copy of the policy.

A sampler receives the policy's weights after every update (``load_weights``, with the policy version: the number of
optimizer steps behind them) and generates completions of token-id prompts with their log-probabilities, as
``torchtitan.generation.Completion``. An outside engine (vLLM, SGLang) plugs in from a user's module named in
``experimental.custom_import``:

    from torchtitan.rl.sampler import SAMPLERS

    class MyEngine:
        def __init__(self, context): ...           # SamplerContext: the config, a model builder, device
        def load_weights(self, state, version): ...  # name -> full tensor, the trainer's names
        def generate(self, prompts, sampling, stop_token_ids): ...  # -> list[Completion], one per prompt
        def close(self): ...

    SAMPLERS.register("my_engine", MyEngine)

The log-probability of each token must be that of the distribution it was drawn from (temperature, top-k, top-p
applied, as torchtitan/generation/sampling.py defines it): GRPO's importance ratio divides by it. None is shipped for
vLLM or SGLang (they cannot be installed on the machines this project is tested on); tests/rl_samplers.py holds a
test double that implements the interface.
"""

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from torchtitan.config.job_config import RL
from torchtitan.generation.engine import Completion, GenerationEngine
from torchtitan.generation.sampling import SamplingConfig
from torchtitan.registry import Registry


class Sampler(Protocol):
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 stop_token_ids: Sequence[int]) -> list[Completion]: ...

    def close(self) -> None: ...


@dataclass
class SamplerContext:
    rl: RL
    build_model: Callable[[], nn.Module]
    """A whole model like the policy (same converters), materialised on ``device``; its weights are the seeded
    initialisation until ``load_weights``."""
    device: torch.device
    autocast: Callable[[], AbstractContextManager]
    """The compute precision the trainer's forward runs in."""
    cfg: Any = None
    """The whole JobConfig, for a sampler that needs more."""


SAMPLERS: Registry[Callable[[SamplerContext], Sampler]] = Registry("RL sampler")


class EngineSampler:
    """The generation engine (torchtitan/generation) on a whole copy of the policy on this device; each rank that
    generates holds one."""

    def __init__(self, context: SamplerContext):
        budget = context.rl.cache_budget_bytes or None
        self.engine = GenerationEngine(context.build_model(), cache_budget_bytes=budget, per_rank=True)
        self.autocast = context.autocast
        self.version = -1

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state)
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 stop_token_ids: Sequence[int]) -> list[Completion]:
        with self.autocast():
            return self.engine.generate(prompts, sampling, stop_token_ids=stop_token_ids)

    def close(self) -> None:
        pass


SAMPLERS.register("engine", EngineSampler)
