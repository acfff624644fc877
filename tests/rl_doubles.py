"""Test doubles for GRPO (imported through experimental.custom_import, also by the generator process):

- sampler "replay": an outside sampler implementing the interface (rl/sampler.py) that serves fixed rollouts from
  ``grpo_rollouts.jsonl`` beside the run's dump folder (one line per completion: the batch's call index, the prompt's
  token ids, the completion's tokens, log-probabilities and finish reason), whatever the weights: every layout
  trains on the same rollouts;
- ``train_checking_logprobs``: the trainer, recording how far its log-probabilities of the sampled tokens are from
  the sampler's;
- sampler "digesting": the engine sampler that, after every load_weights, appends {version, pid, trainer (its parent's
  pid), digest (of its model's state: `state_digest`)} to the JSON-lines file $TORCHTITAN_TEST_DIGESTS, and sleeps
  $TORCHTITAN_TEST_GENERATE_SLEEP seconds per generate (default 0); with $TORCHTITAN_TEST_GENERATE_FAIL set,
  generate raises that text (ValueError), with $TORCHTITAN_TEST_SAMPLER_FAIL set, building it does (RuntimeError);
- sampler "echo": completes every prompt with the prompt's own tokens, no model (large answers, for the transport);
  it records and sleeps as "digesting" does (the digest of the state it was sent);
- reward "text_shape": a reward that varies with the completion's text (its length and characters), so the groups
  of an untrained model's completions are informative; "slow_text_shape": the same after sleeping
  $TORCHTITAN_TEST_REWARD_SLEEP seconds (default 0.05) per completion;
- reward "odd_length": 1 or 0 by the parity of the completion's length, a stand-in for "right or wrong" that an
  untrained model's completions score both ways (held-out pass@k, scripts/rl_eval.py).
"""

import hashlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.components.objectives import grpo
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.generation.engine import Completion
from torchtitan.rl.rewards import REWARDS, register_reward
from torchtitan.rl.sampler import SAMPLERS, EngineSampler


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
    """Keyed by (call, prompt): a data-parallel rank's call holds its share of the batch's prompts, each prompt's
    completions in the file's order."""

    def __init__(self, context):
        self.table = defaultdict(list)
        with open(Path(context.cfg.job.dump_folder).parent / "grpo_rollouts.jsonl") as f:
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


def train_checking_logprobs(argv: list[str]) -> int:
    """The trainer's main, with GRPO's loss also writing per step the largest |trainer - sampler| log-probability of
    any sampled token to ``logprob_gaps.jsonl`` in the dump folder (before the update: both score the same
    weights); the loss is restored afterwards (a matrix launch runs more jobs in this process)."""
    from torchtitan.train import main

    folder = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("--job.dump_folder=")))
    original = grpo.GRPO.loss

    def loss(self, output, targets, global_counts):
        labels = targets[:, 0].long()
        with torch.no_grad():
            ours = grpo.token_logprobs(output, labels, self.sampling)
            gap = ((ours - targets[:, 1].float()).abs() * (labels != IGNORE_INDEX)).max()
            tokens = (labels != IGNORE_INDEX).sum()
            if dist.is_initialized():
                dist.all_reduce(gap, op=dist.ReduceOp.MAX)
                dist.all_reduce(tokens)
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(folder / "logprob_gaps.jsonl", "a") as f:
                f.write(json.dumps({"max_gap": gap.item(), "tokens": int(tokens)}) + "\n")
        return original(self, output, targets, global_counts)

    grpo.GRPO.loss = loss
    try:
        return main(argv)
    finally:
        grpo.GRPO.loss = original


def slow_text_shape(completion: str, sample: dict) -> float:
    time.sleep(float(os.environ.get("TORCHTITAN_TEST_REWARD_SLEEP", "0.05")))
    return text_shape(completion, sample)


def odd_length(completion: str, sample: dict) -> float:
    return float(len(completion) % 2 == 1)


if "replay" not in SAMPLERS:
    SAMPLERS.register("replay", ReplaySampler)
    SAMPLERS.register("digesting", DigestingSampler)
    SAMPLERS.register("echo", EchoSampler)
if "text_shape" not in REWARDS:
    register_reward("text_shape", text_shape)
    register_reward("slow_text_shape", slow_text_shape)
    register_reward("odd_length", odd_length)
