"""GRPO's data source: each step's micro-batches are completions the policy itself sampled, scored and packed.

For every batch of rollouts (one per ``rl.epochs_per_batch`` optimizer steps):
1. The sampler gets the policy's current weights (full tensors gathered from any layout) and its version, the number
   of optimizer steps behind them. With ``rl.max_staleness = k > 0`` a generator process works ahead instead, from
   weights up to k versions old, sent to it after every step (async_generation.py); the rest is the same.
2. Each data-parallel rank takes its share of the step's ``rl.prompts_per_step`` prompts (a stream position, the same
   on every rank), and samples ``rl.group_size`` completions of each, seeded by (debug.seed, batch, rank): rerunning
   a batch reproduces it. Of the ranks that share a batch (tensor, pipeline, context parallel peers) the first
   generates and the others receive its packed batch, so they never disagree.
3. The rewards (rewards.py, in worker processes) give each completion its reward; a group's advantages are its
   rewards against their mean (and std); groups whose rewards are all equal are left out (``rl.filter_equal_rewards``).
4. Prompt + completion sequences are packed whole into the step's rows (training.local_batch_size x accumulation
   steps of training.seq_len tokens), first-fit by length, each its own document (block-causal attention, positions
   from 0), labels only on completion tokens; the rest of a row is padding with no labels. Rollouts that do not fit
   stop the run with what to change.
5. With a reference model (rl.kl_coeff > 0) its log-probabilities of the labels are added.

The step's statistics are reported through ``metrics()`` (namespace "rl"): rewards (total and per function), their
failures, completion lengths, the truncated share, filtered groups, the policy version of the step and the oldest
version its rollouts came from (over ranks) and their difference, the staleness; generation seconds (loading the
weights and generating, or waiting for the generator process) and update seconds (from one batch to the next).
"""

import dataclasses
import time
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.objectives.grpo import RolloutBatch, group_advantages, informative_groups, rl_sampling
from torchtitan.components.objectives.objective import DataSourceContext
from torchtitan.config import ConfigError
from torchtitan.config.job_config import RL
from torchtitan.data import DataError
from torchtitan.data.chat_template import ChatTemplate
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.distributed.precision import compute_autocast
from torchtitan.generation.engine import Completion
from torchtitan.generation.sampling import SamplingConfig
from torchtitan.log import logger
from torchtitan.models.shared.seeded_init import canonical_name
from torchtitan.rl.async_generation import GeneratorProcess
from torchtitan.rl.reference import ReferenceModel
from torchtitan.rl.rewards import RewardPool
from torchtitan.rl.sampler import SAMPLERS, SamplerContext
from torchtitan.rl.tasks import build_prompt_source, prompt_ids


def policy_state(model_parts: list[torch.nn.Module], group: dist.ProcessGroup | None = None,
                 destination: int = 0) -> dict[str, torch.Tensor] | None:
    """The policy's parameters and persistent buffers as full tensors under their model names. Every rank takes
    part (sharded tensors are gathered); with ``group`` (the ranks holding the other pipeline stages) the stages'
    states are merged on global rank ``destination`` alone, the others get None."""
    state = {}
    for part in model_parts:
        for name, value in part.state_dict().items():
            state[canonical_name(name)] = value.full_tensor() if isinstance(value, DTensor) else value
    if group is None:
        return state
    state = {name: value.cpu() for name, value in state.items()}
    received = [None] * dist.get_world_size(group) if dist.get_rank() == destination else None
    dist.gather_object(state, received, dst=destination, group=group)
    return None if received is None else {name: t for stage in received for name, t in stage.items()}


def data_sharing_group(dp_rank: int) -> tuple[dist.ProcessGroup | None, int]:
    """(a gloo group of the ranks that train on this rank's data, i.e. share its data-parallel rank: its tensor,
    pipeline and context parallel peers; None when it has none, the group's first global rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None, 0
    owners = [None] * dist.get_world_size()
    dist.all_gather_object(owners, dp_rank)
    mine = None
    for shared in sorted(set(owners)):  # every rank creates every group, in the same order
        members = [rank for rank, owner in enumerate(owners) if owner == shared]
        group = dist.new_group(members, backend="gloo")  # rollouts are CPU tensors, whatever the device
        if shared == dp_rank:
            mine = (group if len(members) > 1 else None, members[0])
    return mine


def pack(sequences: list[tuple[list[int], Completion, float]], rows: int, seq_len: int,
         pad_id: int) -> RolloutBatch | None:
    """(prompt ids, completion, advantage) packed into ``rows`` rows of ``seq_len``; None if they do not fit.

    A sequence of L = prompt + completion tokens takes L - 1 positions: its tokens but the last as inputs, the
    next token as label where that is a completion token.
    """
    fields = {name: torch.zeros(rows, seq_len, dtype=torch.float32) for name in RolloutBatch._fields[4:]}
    input_ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
    document_ids = torch.zeros(rows, seq_len, dtype=torch.long)
    positions = torch.zeros(rows, seq_len, dtype=torch.long)
    used, documents = [0] * rows, [0] * rows
    order = sorted(range(len(sequences)), key=lambda i: -(len(sequences[i][0]) + len(sequences[i][1].tokens)))
    for i in order:
        prompt, completion, advantage = sequences[i]
        tokens = list(prompt) + completion.tokens
        width = len(tokens) - 1
        row = next((r for r in range(rows) if used[r] + width <= seq_len), None)
        if row is None:
            return None
        start, end = used[row], used[row] + width
        first_label = start + len(prompt) - 1  # the position whose next token is the completion's first
        input_ids[row, start:end] = torch.tensor(tokens[:-1])
        labels[row, first_label:end] = torch.tensor(completion.tokens)
        document_ids[row, start:end] = documents[row]
        positions[row, start:end] = torch.arange(width)
        fields["sampler_logprobs"][row, first_label:end] = torch.tensor(completion.logprobs)
        fields["advantages"][row, first_label:end] = advantage
        fields["inverse_lengths"][row, first_label:end] = 1 / len(completion.tokens)
        used[row], documents[row] = end, documents[row] + 1
    for row in range(rows):  # the rest of the row: padding, a document of its own with no labels
        document_ids[row, used[row]:] = documents[row]
        positions[row, used[row]:] = torch.arange(seq_len - used[row])
    return RolloutBatch(input_ids, labels, document_ids, positions, *fields.values())


class BatchInputs(NamedTuple):
    """What one batch of rollouts is generated from on this rank."""

    step: int  # the step it is made for
    index: int  # batches made before it
    samples: list[dict]  # this rank's share of the step's prompts
    prompts: list[list[int]]  # their token ids
    sampling: SamplingConfig  # with the batch's seed


def check_staleness(inputs: BatchInputs, step: int, index: int, version: int, max_staleness: int) -> None:
    """The bound of asynchronous GRPO: the batch received from the generator is batch ``index``, made for ``step``,
    and comes from policy version step - max_staleness or newer; DataError otherwise."""
    if (inputs.step, inputs.index) != (step, index) or version < step - max_staleness:
        raise DataError(f"rl: batch {inputs.index} (for step {inputs.step}) came from policy version {version}, but "
                        f"step {step} needs batch {index} from version {step - max_staleness} or newer "
                        f"(rl.max_staleness = {max_staleness}): the generator process broke the staleness bound")


class RolloutSource:
    """The trainer's iterator of micro-batches under training.objective = "grpo" (see the module docstring)."""

    metrics_namespace = "rl"

    def __init__(self, rl: RL, context: DataSourceContext):
        cfg = context.cfg
        self.rl, self.context = rl, context
        self.sampling = rl_sampling(rl)
        self.tokenizer = context.tokenizer
        self.rows = cfg.training.local_batch_size
        self.seq_len = cfg.training.seq_len
        self.accumulation = context.grad_accum_steps
        self.prompts = build_prompt_source(rl, context.seed)
        self.per_rank = rl.prompts_per_step // context.dp_degree
        self.template = ChatTemplate(self.tokenizer.chat_template) if rl.chat else None
        # The ranks that share this rank's batch (its tensor, pipeline and context parallel peers): the first
        # generates, the others receive; metrics are summed over a gloo group of all ranks (CPU tensors).
        self.share_group, self.first = data_sharing_group(context.dp_rank)
        self.generates = self.share_group is None or dist.get_rank() == self.first
        self.pipeline = context.parallel_dims.pp_enabled
        self.metrics_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.sampler = self.rewards = self.generator = None
        if self.generates:
            if rl.max_staleness > 0:
                self.generator = GeneratorProcess(cfg, context.device)  # starts while the trainer sets up
            else:
                # The sampler computes as the trainer's forward does (FSDP's mixed precision included).
                autocast = compute_autocast(cfg.training, context.device, fsdp_enabled=False)
                self.sampler = SAMPLERS.get(rl.sampler)(SamplerContext(rl, context.build_local_model, context.device,
                                                                       autocast, cfg))
            try:
                self.rewards = RewardPool(rl.rewards, rl.reward_weights, rl.reward_workers,
                                          rl.reward_timeout_seconds)
            except RuntimeError as e:  # a worker that cannot start, e.g. a reward's module fails to import there
                raise ConfigError(f"rl.rewards = {rl.rewards}: {e}") from None
        self.reference = None
        if rl.kl_coeff > 0:
            self.reference = ReferenceModel(context.model_parts[0], context.build_model_part, self.sampling,
                                            lambda batch: context.masking.model_inputs(batch), context.autocast,
                                            context.loss_parallel)
        self.handed = 0  # micro-batches handed to the trainer
        self.next_prompt = 0  # stream position of the next batch's first prompt
        self.batches = 0  # batches of rollouts made
        self.current: list[RolloutBatch] = []
        # rl.max_staleness > 0: the batches requested from the generator and not yet received, and (step, index,
        # stream position) of the next to request (None: the next batch is made for the step that asks for it).
        self.requested: deque[BatchInputs] = deque()
        self.next_request: tuple[int, int, int] | None = None
        self._metrics: dict[str, float] = {}
        self._last_end: float | None = None

    def checkpoint_states(self) -> dict:
        """Checkpointed beside the trainer's state (train.py adds them): the reference model's weights."""
        return {"reference": self.reference} if self.reference is not None and self.reference.model is not None \
            else {}

    def __iter__(self):
        return self

    def __next__(self) -> RolloutBatch:
        step, within = divmod(self.handed, self.accumulation)
        if within == 0:
            if self.rl.max_staleness > 0:
                self._work_ahead(step)
            if step % self.rl.epochs_per_batch == 0 or not self.current:
                self.current = self._make_batch(step)
        self.handed += 1
        return self.current[within]

    def state_dict(self) -> dict:
        return {"handed": self.handed, "next_prompt": self.next_prompt, "batches": self.batches,
                "seed": self.context.seed, "reference": self.reference.source if self.reference else None}

    def load_state_dict(self, state: dict) -> None:
        self.handed, self.next_prompt, self.batches = state["handed"], state["next_prompt"], state["batches"]
        self.current = []  # a resume in the middle of a batch's epochs makes the next batch at once
        if self.requested:  # rollouts in flight were for the old position: a new generator starts over
            self.generator.close()
            self.generator = GeneratorProcess(self.context.cfg, self.context.device, self.generator.threads)
            self.requested.clear()
        self.next_request = None

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if self.sampler is not None:
            self.sampler.close()
        if self.generator is not None:
            self.generator.close()

    # ----- one batch of rollouts -----

    def _work_ahead(self, step: int) -> None:
        """rl.max_staleness = k > 0, at the start of each step: send the generator the policy's weights (version
        ``step``) and request every batch of a step up to step + k not yet requested."""
        state = self._policy_state()
        if self.generator is None:
            return
        self.generator.send_weights(state, step)
        del state
        if self.next_request is None:  # the run's first step, or the first after a resume: it makes a batch
            self.next_request = (step, self.batches, self.next_prompt)
        k, epochs = self.rl.max_staleness, self.rl.epochs_per_batch
        while self.next_request[0] - k <= step:
            inputs = self._inputs(*self.next_request)
            self.generator.request(self._group_prompts(inputs), inputs.sampling, [self.tokenizer.eos_id],
                                   min_version=max(0, inputs.step - k))
            self.requested.append(inputs)
            self.next_request = ((inputs.step // epochs + 1) * epochs, inputs.index + 1,
                                 self.next_request[2] + self.rl.prompts_per_step)

    def _make_batch(self, step: int) -> list[RolloutBatch]:
        start = time.perf_counter()
        update_seconds = start - self._last_end if self._last_end is not None else 0.0
        rows = self.rows * self.accumulation
        if self.rl.max_staleness == 0:
            state = self._policy_state()
        if self.generates:
            if self.rl.max_staleness == 0:
                inputs = self._inputs(step, self.batches, self.next_prompt)
                self.sampler.load_weights(state, step)
                del state
                completions = self.sampler.generate(self._group_prompts(inputs), inputs.sampling,
                                                    [self.tokenizer.eos_id])
                version = step
            else:
                inputs = self.requested.popleft()
                completions, version = self.generator.receive()
                check_staleness(inputs, step, self.batches, version, self.rl.max_staleness)
            generation_seconds = time.perf_counter() - start
            packed, stats = self._score_and_pack(inputs, completions, rows, version)
        else:
            packed, stats = RolloutBatch(*(torch.empty(rows, self.seq_len, dtype=torch.long) for _ in range(4)),
                                         *(torch.empty(rows, self.seq_len) for _ in range(4))), None
            generation_seconds = 0.0
        self.next_prompt += self.rl.prompts_per_step
        self.batches += 1
        if self.share_group is not None:
            for tensor in packed:
                dist.broadcast(tensor, src=self.first, group=self.share_group)
        micro = [RolloutBatch(*(t[i * self.rows:(i + 1) * self.rows] for t in packed))
                 for i in range(self.accumulation)]
        if self.reference is not None:
            micro = [batch._replace(ref_logprobs=self.reference.logprobs(self._on_device(batch)).cpu())
                     for batch in micro]
        self._metrics = self._global_metrics(stats, generation_seconds, update_seconds)
        self._last_end = time.perf_counter()
        return micro

    def _policy_state(self) -> dict[str, torch.Tensor] | None:
        """The whole policy on the generating rank (None on the others); every rank takes part: gathering shards
        and pipeline stages is collective."""
        return policy_state(self.context.model_parts, self.share_group if self.pipeline else None, self.first)

    def _on_device(self, batch: RolloutBatch) -> RolloutBatch:
        return RolloutBatch(*(t.to(self.context.device) for t in batch))

    def prompt_ids(self, sample: dict) -> list[int]:
        return prompt_ids(self.tokenizer, self.template, sample["prompt"])

    def _inputs(self, step: int, index: int, position: int) -> BatchInputs:
        """Batch ``index``'s prompts on this rank (from stream ``position``) and its seed: (seed, batch, rank), so
        rerunning a batch reproduces it."""
        first = position + self.context.dp_rank * self.per_rank
        samples = [self.prompts[first + i] for i in range(self.per_rank)]
        prompts = [self.prompt_ids(s) for s in samples]
        for prompt, sample in zip(prompts, samples):
            if len(prompt) >= self.seq_len:
                raise DataError(f"rl: a prompt of {len(prompt)} tokens does not fit training.seq_len = "
                                f"{self.seq_len} with room to answer: {sample['prompt'][:80]!r}")
        seed = (self.context.seed * 1_000_003 + index * 1_009 + self.context.dp_rank) % (1 << 62)
        return BatchInputs(step, index, samples, prompts, dataclasses.replace(self.sampling, seed=seed))

    def _group_prompts(self, inputs: BatchInputs) -> list[list[int]]:
        return [p for p in inputs.prompts for _ in range(self.rl.group_size)]

    def _score_and_pack(self, inputs: BatchInputs, completions: list[Completion], rows: int, version: int):
        """The completions scored, their groups' advantages, packed into ``rows`` rows; and the batch's statistics."""
        group, samples, prompts, seed = self.rl.group_size, inputs.samples, inputs.prompts, inputs.sampling.seed
        texts = [self.tokenizer.decode(c.tokens[:-1] if c.finish_reason == "stop" else c.tokens)
                 for c in completions]
        scores = self.rewards.score(texts, [s for s in samples for _ in range(group)])
        rewards = torch.tensor(scores.total, dtype=torch.float64).view(len(samples), group)
        if self.rl.shuffle_rewards:  # the control run: the same amount of reward, given to random completions
            order = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(seed))
            rewards = rewards.flatten()[order].view_as(rewards)
        advantages = group_advantages(rewards, self.rl.normalize_advantages)
        informative = informative_groups(rewards)
        keep = informative if self.rl.filter_equal_rewards else torch.ones_like(informative)
        sequences = [(prompts[g], completions[g * group + j], float(advantages[g, j]))
                     for g in range(len(samples)) if keep[g] for j in range(group)]
        packed = pack(sequences, rows, self.seq_len, self.tokenizer.eos_id)
        if packed is None:
            need = sum(len(prompts[g // group]) + len(c.tokens) - 1 for g, c in enumerate(completions))
            raise DataError(
                f"rl: the rollouts of batch {inputs.index} ({len(sequences)} sequences, {need} positions) do not "
                f"fit this rank's {rows} rows of training.seq_len = {self.seq_len} (training.local_batch_size x "
                "gradient accumulation); raise training.local_batch_size, training.global_batch_size or "
                "training.seq_len, or lower rl.prompts_per_step, rl.group_size or rl.max_new_tokens")
        lengths = torch.tensor([len(c.tokens) for c in completions], dtype=torch.float64)
        per_function = torch.tensor([scores.per_function[name] for name in self.rl.rewards], dtype=torch.float64).T
        stats = {"rewards": rewards.flatten(), "per_function": per_function, "lengths": lengths,
                 "truncated": torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.float64),
                 "groups": len(samples), "filtered": int((~keep).sum()),
                 "failures": torch.tensor([scores.failures.get(name, 0) for name in self.rl.rewards],
                                          dtype=torch.float64), "version": version}
        for name, error in scores.first_errors.items():
            logger.warning(f"rl: reward {name} failed on {scores.failures.get(name, 0)} of {len(texts)} completions "
                           f"of batch {inputs.index} (scored 0), e.g.: {error}")
        return packed, stats

    def _global_metrics(self, stats: dict | None, generation_seconds: float, update_seconds: float) -> dict:
        """The batch's statistics over all data-parallel ranks (the first of the ranks sharing a batch counts)."""
        functions = len(self.rl.rewards)
        # The longest completion and the oldest version, as maxima (of the version's negative).
        if stats is None:
            sums = torch.zeros(7 + 3 * functions, dtype=torch.float64)
            maxima = torch.tensor([0.0, -float("inf")], dtype=torch.float64)
        else:
            r = stats["rewards"]
            sums = torch.cat([
                torch.tensor([r.numel(), r.sum(), (r * r).sum(), stats["lengths"].sum(), stats["truncated"].sum(),
                              stats["groups"], stats["filtered"]], dtype=torch.float64),
                stats["per_function"].sum(0), (stats["per_function"] ** 2).sum(0), stats["failures"]])
            maxima = torch.stack([stats["lengths"].max(), torch.tensor(-stats["version"], dtype=torch.float64)])
        if self.metrics_group is not None:
            # Every rank takes part; the ranks that only received their batch add zeros.
            dist.all_reduce(sums, group=self.metrics_group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.metrics_group)
        longest, oldest = maxima[0].item(), -int(maxima[1].item())
        policy_version = self.handed // self.accumulation
        n, total, squares, length, truncated, groups, filtered = sums[:7].tolist()
        mean = total / n
        metrics = {"reward_mean": mean, "reward_std": max(squares / n - mean * mean, 0.0) ** 0.5,
                   "completion_length_mean": length / n, "completion_length_max": float(longest),
                   "truncated_share": truncated / n, "filtered_groups": filtered, "groups": groups,
                   "generation_seconds": generation_seconds, "update_seconds": update_seconds,
                   "policy_version": policy_version, "sampler_version": oldest,
                   "staleness": policy_version - oldest}
        values, squares, failures = sums[7:].view(3, functions).tolist()
        for name, value, square, failed in zip(self.rl.rewards, values, squares, failures):
            metrics[f"reward/{name}"] = value / n
            metrics[f"reward_std/{name}"] = max(square / n - (value / n) ** 2, 0.0) ** 0.5
            metrics[f"reward_failures/{name}"] = failed
        return metrics
