"""Test doubles for GRPO (imported through experimental.custom_import, also by the generator process):

- sampler "recording": the engine sampler that also appends every completion it generates to a JSON-lines file
  ($TORCHTITAN_TEST_ROLLOUTS.rank<R>), one line per (batch, prompt), with the policy version;
- sampler "replay": an outside sampler implementing the interface (rl/sampler.py) from such a file: every batch's
  completions as recorded, whatever the weights (fixed rollouts, for comparing layouts);
- reward "text_shape": a reward that varies with the completion's text (its length and characters), so the groups
  of an untrained model's completions are informative;
- reward "odd_length": 1 or 0 by the parity of the completion's length, a stand-in for "right or wrong" that an
  untrained model's completions score both ways (held-out pass@k, scripts/rl_eval.py).
"""

import json
import os
from collections import defaultdict

import torch.distributed as dist

from torchtitan.generation.engine import Completion
from torchtitan.rl.rewards import REWARDS, register_reward
from torchtitan.rl.sampler import SAMPLERS, EngineSampler


def _path() -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"{os.environ['TORCHTITAN_TEST_ROLLOUTS']}.rank{rank}"


class RecordingSampler(EngineSampler):
    def __init__(self, context):
        super().__init__(context)
        self.calls = 0

    def generate(self, prompts, sampling, stop_token_ids):
        completions = super().generate(prompts, sampling, stop_token_ids)
        with open(_path(), "a") as f:
            for prompt, c in zip(prompts, completions):
                f.write(json.dumps({"call": self.calls, "prompt": list(prompt), "tokens": c.tokens,
                                    "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                                    "version": self.version}) + "\n")
        self.calls += 1
        return completions


class ReplaySampler:
    """Completions read from the recordings of every rank of a run (any layout): keyed by (call, prompt), each
    prompt's completions in recorded order."""

    def __init__(self, context):
        base = os.environ["TORCHTITAN_TEST_ROLLOUTS"]
        folder, stem = os.path.split(base)
        self.table = defaultdict(list)
        for name in sorted(os.listdir(folder or ".")):
            if name.startswith(os.path.basename(stem) + ".rank"):
                with open(os.path.join(folder, name)) as f:
                    for line in f:
                        r = json.loads(line)
                        self.table[(r["call"], tuple(r["prompt"]))].append(r)
        self.calls = 0
        self.versions = []

    def load_weights(self, state, version):
        self.versions.append(version)

    def generate(self, prompts, sampling, stop_token_ids):
        taken = defaultdict(int)
        out = []
        for prompt in prompts:
            key = (self.calls, tuple(prompt))
            r = self.table[key][taken[key]]
            taken[key] += 1
            out.append(Completion(tokens=r["tokens"], logprobs=r["logprobs"], finish_reason=r["finish_reason"]))
        self.calls += 1
        return out

    def close(self):
        pass


def text_shape(completion: str, sample: dict) -> float:
    return (len(completion) % 5) / 4 + 0.25 * sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)


def odd_length(completion: str, sample: dict) -> float:
    return float(len(completion) % 2 == 1)


if "recording" not in SAMPLERS:
    SAMPLERS.register("recording", RecordingSampler)
    SAMPLERS.register("replay", ReplaySampler)
if "text_shape" not in REWARDS:
    register_reward("text_shape", text_shape)
if "odd_length" not in REWARDS:
    register_reward("odd_length", odd_length)
