"""The GRPO loss (Group Relative Policy Optimization, Shao et al., arXiv 2402.03300), with the variants RL trainers
use since: asymmetric clipping (DAPO, arXiv 2503.14476) and the aggregations of GRPO, DAPO and Dr. GRPO
(arXiv 2503.20783).

For a prompt, a group of G completions o_1..o_G is sampled and scored r_1..r_G. Each completion's advantage is its
reward against its group's:

    A_i = r_i - mean(r)                      (normalize_std = False: Dr. GRPO)
    A_i = (r_i - mean(r)) / (std(r) + eps)   (normalize_std = True: GRPO; std with Bessel's correction, eps 1e-4)

A group whose rewards are all equal has A = 0 everywhere: it teaches nothing, and is filtered before the update.
Per completion token t, with the policy's log-probability logp_t, the sampling policy's old_t and the ratio
rho_t = exp(logp_t - old_t):

    L_t = -min(rho_t A_i, clip(rho_t, 1 - clip_low, 1 + clip_high) A_i) + kl_coeff * KL_t
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (the k3 estimator of KL(policy || reference), >= 0)

and the step's loss aggregates the L_t of all its completions (|o_i| tokens each, N completions in the step):

    "sequence_mean": (1/N) sum_i (1/|o_i|) sum_t L_t            (GRPO: every completion weighs the same)
    "token_mean":    (1 / sum_i |o_i|) sum_i sum_t L_t          (DAPO: every token weighs the same)
    "token_sum":     (1 / (N * max_new_tokens)) sum_i sum_t L_t (Dr. GRPO: a constant normaliser, no length bias)

The normalisers are of the whole step (all micro-batches and ranks), so the loss is the same in any layout.
"""

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.components.objectives.objective import loss_parts
from torchtitan.config.job_config import RL
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.generation.sampling import SamplingConfig, processed_logits

AGGREGATIONS = ("sequence_mean", "token_mean", "token_sum")


def group_advantages(rewards: torch.Tensor, normalize_std: bool, eps: float = 1e-4) -> torch.Tensor:
    """(groups, G) rewards -> (groups, G) advantages (float32 at least)."""
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(groups,) bool: the groups whose rewards are not all equal (the others have zero advantages)."""
    return (rewards != rewards[:, :1]).any(dim=1)


@dataclass
class TokenLosses:
    losses: torch.Tensor
    """(B, T) L_t, zero off the completion tokens."""
    clipped: torch.Tensor
    """(B, T) bool: tokens where the clipped term was the smaller (its gradient is zero)."""
    kl: torch.Tensor | None
    """(B, T) KL_t, or None without a reference."""


def token_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 clip_low: float, clip_high: float, kl_coeff: float = 0.0,
                 ref_logprobs: torch.Tensor | None = None) -> TokenLosses:
    """L_t for (B, T) log-probabilities of the sampled tokens (``mask``: True on completion tokens) and advantages
    per row (B,) or per token (B, T) (rows packing several completions); ``ref_logprobs`` needed when kl_coeff > 0."""
    if kl_coeff > 0 and ref_logprobs is None:
        raise ValueError("kl_coeff > 0 needs the reference model's log-probabilities")
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    losses = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logprobs is not None and kl_coeff > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        losses = losses + kl_coeff * kl
    mask = mask.to(torch.bool)
    return TokenLosses(losses.masked_fill(~mask, 0.0), (clipped < unclipped) & mask,
                       None if kl is None else kl.masked_fill(~mask, 0.0))


def aggregate(losses: torch.Tensor, mask: torch.Tensor, how: str, sequences: int | torch.Tensor,
              tokens: int | torch.Tensor, max_new_tokens: int,
              inverse_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's share of the step's loss: ``sequences`` and ``tokens`` are the step's totals (all
    micro-batches and ranks), so the shares of a step sum to its loss. ``inverse_lengths`` (B, T): 1 / |o_i| on
    each token of completion i, for rows that pack several; by default each row is one completion."""
    if how == "sequence_mean":
        if inverse_lengths is None:
            inverse_lengths = (1 / mask.sum(dim=1, keepdim=True).clamp(min=1).to(losses.dtype)).expand_as(losses)
        return (losses * inverse_lengths.to(losses.dtype)).sum() / sequences
    if how == "token_mean":
        return losses.sum() / tokens
    if how == "token_sum":
        return losses.sum() / (sequences * max_new_tokens)
    raise ValueError(f"rl.loss_aggregation = {how!r} is invalid; valid: {', '.join(AGGREGATIONS)}")


class RolloutBatch(NamedTuple):
    """One micro-batch of packed rollouts (every field [local_batch_size, seq_len]): ``Batch``'s four fields
    (labels are the completion tokens, IGNORE_INDEX elsewhere), then per label position the sampler's
    log-probability of that token, its completion's advantage, 1 / its completion's length, and the reference
    model's log-probability (zeros without a reference)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    inverse_lengths: torch.Tensor
    ref_logprobs: torch.Tensor


def rl_sampling(rl: RL) -> SamplingConfig:
    """The distribution rollouts are drawn from; the trainer scores their tokens under the same one."""
    return SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k,
                          top_p=rl.top_p)


def token_logprobs(logits: Any, labels: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(B, T) float32 log-probability of each label under the sampling distribution of ``logits`` (B, T, V): the
    temperature-scaled logits, top-k / top-p filtered as the sampler filtered them; 0 where the label is ignored.

    Tensor-parallel logits sharded over the vocabulary stay sharded (loss parallelism's cross-entropy) unless
    top-k / top-p need the whole row.
    """
    if isinstance(logits, DTensor) and (sampling.top_k > 0 or sampling.top_p < 1):
        logits = logits.full_tensor()
    if isinstance(logits, DTensor):
        scaled = logits.float() / sampling.temperature
    else:
        scaled = processed_logits(logits, sampling)
    nll = F.cross_entropy(scaled.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.full_tensor()
    return -nll.view(labels.shape)


@torch.no_grad()
def token_entropy(logits: Any, sampling: SamplingConfig) -> torch.Tensor:
    """(B, T) entropy of each position's sampling distribution (a metric: no gradient)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    log_probs = processed_logits(logits, sampling).log_softmax(-1)
    return -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(-1)


class GRPO:
    """The clipped policy-gradient loss above on packed rollouts (training.objective = "grpo" is this objective with
    torchtitan/rl's rollouts as its data source: rl/objective.py).

    Targets stack, per label position: the label, the sampler's log-probability, the advantage, 1 / completion
    length and the reference log-probability, (batch, 5, seq) in float64 (token ids are exact in it). Counted per
    step: completion tokens and completions. Besides the loss it reports, as means over the step's completion tokens:
    the share of clipped tokens, the entropy, the KL to the reference (0 without one), and the trainer-sampler
    mismatch of the sampled tokens' log-probabilities: mean |trainer - sampler| and the k3 estimate of
    KL(sampler || trainer). With epochs_per_batch = 1 and no staleness the trainer's weights are the sampler's, so
    the mismatch is numerics alone; on a batch's later epochs, or stale rollouts, it includes the policy's change.
    """

    metric_names = ("rl/clip_fraction", "rl/entropy", "rl/kl", "rl/mismatch_abs", "rl/mismatch_kl")

    def __init__(self, rl: RL):
        self.rl = rl
        self.sampling = rl_sampling(rl)

    def prepare(self, batch: RolloutBatch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if not isinstance(batch, RolloutBatch):
            raise TypeError("training.objective = 'grpo' trains on rollouts (RolloutBatch), not a dataset's batches")
        fields = (batch.labels, batch.sampler_logprobs, batch.advantages, batch.inverse_lengths, batch.ref_logprobs)
        return {}, torch.stack([f.double() for f in fields], dim=1)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        # A completion's 1 / length summed over its tokens is 1; rows hold whole completions, so a micro-batch's sum
        # is a whole number up to rounding.
        tokens = (targets[:, 0] != IGNORE_INDEX).sum().double()
        return torch.stack([tokens, targets[:, 3].sum().round()])

    def loss(self, output: Any, targets: torch.Tensor,
             global_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = targets[:, 0].long()
        mask = labels != IGNORE_INDEX
        sampler, advantages, inverse_lengths, ref = (targets[:, i].float() for i in range(1, 5))
        logprobs = token_logprobs(output, labels, self.sampling)
        rl = self.rl
        per_token = token_losses(logprobs, sampler, advantages, mask, rl.clip_low, rl.clip_high, rl.kl_coeff,
                                 ref if rl.kl_coeff > 0 else None)
        tokens, sequences = global_counts[0].float(), global_counts[1].float()
        loss = aggregate(per_token.losses, mask, rl.loss_aggregation, sequences, tokens, rl.max_new_tokens,
                         inverse_lengths)
        with torch.no_grad():
            diff = (logprobs - sampler).masked_fill(~mask, 0.0)
            per_token_mean = [per_token.clipped.float(), token_entropy(output, self.sampling) * mask, diff.abs(),
                              (torch.expm1(diff) - diff) * mask]
            kl = per_token.kl if per_token.kl is not None else torch.zeros_like(diff)
            per_token_mean.insert(2, kl)
            means = [x.sum() / tokens for x in per_token_mean]
        return loss, loss_parts(loss, *means)
