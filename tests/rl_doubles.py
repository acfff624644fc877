"""Test doubles for GRPO (imported through experimental.custom_import, also by the generator process):

- sampler "recording": the engine sampler that also appends every completion it generates to a JSON-lines file
  ($TORCHTITAN_TEST_ROLLOUTS.rank<R>), one line per (batch, prompt), with the policy version;
- sampler "replay": an outside sampler implementing the interface (rl/sampler.py) from such a file: every batch's
  completions as recorded, whatever the weights (fixed rollouts, for comparing layouts);
- sampler "digesting": the engine sampler that, after every load_weights, appends {version, pid, trainer (its parent's
  pid), digest (of its model's state: `state_digest`)} to the JSON-lines file $TORCHTITAN_TEST_DIGESTS, and sleeps
  $TORCHTITAN_TEST_GENERATE_SLEEP seconds per generate (default 0); with $TORCHTITAN_TEST_GENERATE_FAIL set,
  generate raises that text (ValueError), with $TORCHTITAN_TEST_SAMPLER_FAIL set, building it does (RuntimeError);
- sampler "echo": completes every prompt with the prompt's own tokens, no model (large answers, for the transport);
  it records and sleeps as "digesting" does (the digest of the state it was sent);
- reward "text_shape": a reward that varies with the completion's text (its length and characters), so the groups
  of an untrained model's completions are informative; "slow_text_shape": the same after sleeping
  $TORCHTITAN_TEST_REWARD_SLEEP seconds (default 0.05) per completion.
"""

import hashlib
import json
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from torchtitan.generation.engine import Completion
from torchtitan.rl.rewards import REWARDS, register_reward
from torchtitan.rl.sampler import SAMPLERS, EngineSampler


def _path() -> str:
    # A generator process (rl.max_staleness > 0) has no process group; it inherits its trainer's RANK.
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
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


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of the tensors' names, dtypes, shapes and bytes, in name order: equal digests, bitwise equal states."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _record_weights(version: int, state: dict[str, torch.Tensor]) -> None:
    if path := os.environ.get("TORCHTITAN_TEST_DIGESTS"):
        with open(path, "a") as f:
            f.write(json.dumps({"version": version, "pid": os.getpid(), "trainer": os.getppid(),
                                "digest": state_digest(state)}) + "\n")


def _before_generating() -> None:
    time.sleep(float(os.environ.get("TORCHTITAN_TEST_GENERATE_SLEEP", "0")))
    if failure := os.environ.get("TORCHTITAN_TEST_GENERATE_FAIL"):
        raise ValueError(failure)


class DigestingSampler(EngineSampler):
    def __init__(self, context):
        if failure := os.environ.get("TORCHTITAN_TEST_SAMPLER_FAIL"):
            raise RuntimeError(failure)
        super().__init__(context)

    def load_weights(self, state, version):
        super().load_weights(state, version)
        _record_weights(version, self.engine.model.state_dict())

    def generate(self, prompts, sampling, stop_token_ids):
        _before_generating()
        return super().generate(prompts, sampling, stop_token_ids)


class EchoSampler:
    def __init__(self, context):
        pass

    def load_weights(self, state, version):
        _record_weights(version, state)

    def generate(self, prompts, sampling, stop_token_ids):
        _before_generating()
        return [Completion(tokens=list(p), logprobs=[0.0] * len(p)) for p in prompts]

    def close(self):
        pass


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


def slow_text_shape(completion: str, sample: dict) -> float:
    time.sleep(float(os.environ.get("TORCHTITAN_TEST_REWARD_SLEEP", "0.05")))
    return text_shape(completion, sample)


if "recording" not in SAMPLERS:
    SAMPLERS.register("recording", RecordingSampler)
    SAMPLERS.register("replay", ReplaySampler)
    SAMPLERS.register("digesting", DigestingSampler)
    SAMPLERS.register("echo", EchoSampler)
if "text_shape" not in REWARDS:
    register_reward("text_shape", text_shape)
    register_reward("slow_text_shape", slow_text_shape)
