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

import torch

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
    """L_t for (B, T) log-probabilities of the sampled tokens (``mask``: True on completion tokens) and (B,)
    advantages; ``ref_logprobs`` needed when kl_coeff > 0."""
    if kl_coeff > 0 and ref_logprobs is None:
        raise ValueError("kl_coeff > 0 needs the reference model's log-probabilities")
    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages[:, None].to(ratio.dtype)
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
              tokens: int | torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss: ``sequences`` and ``tokens`` are the step's totals (all
    micro-batches and ranks), so the shares of a step sum to its loss."""
    if how == "sequence_mean":
        lengths = mask.sum(dim=1).clamp(min=1)
        return (losses.sum(dim=1) / lengths).sum() / sequences
    if how == "token_mean":
        return losses.sum() / tokens
    if how == "token_sum":
        return losses.sum() / (sequences * max_new_tokens)
    raise ValueError(f"rl.loss_aggregation = {how!r} is invalid; valid: {', '.join(AGGREGATIONS)}")
