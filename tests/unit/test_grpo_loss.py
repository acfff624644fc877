"""The GRPO loss and its gradient on a hand-made batch (two groups of three completions, fixed log-probabilities and
rewards, clipping active on some tokens) against a direct computation: a loop over tokens with the formulas of
components/objectives/grpo.py's docstring and the gradient written out by hand."""

import math

import pytest
import torch

from torchtitan.components.objectives.grpo import aggregate, group_advantages, informative_groups, token_losses

CLIP_LOW, CLIP_HIGH, MAX_NEW = 0.2, 0.28, 5
# Two prompts, three completions each (rows 0-2 and 3-5), of 5, 3, 4, 2, 5 and 1 tokens.
LENGTHS = [5, 3, 4, 2, 5, 1]
REWARDS = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[t < n for t in range(MAX_NEW)] for n in LENGTHS])
    old = -torch.rand(6, MAX_NEW, generator=generator, dtype=torch.float64) * 3
    # Ratios from exp(-0.6) to exp(0.6): many tokens outside [0.8, 1.28], on either side.
    logprobs = old + (torch.rand(6, MAX_NEW, generator=generator, dtype=torch.float64) - 0.5) * 1.2
    ref = old + (torch.rand(6, MAX_NEW, generator=generator, dtype=torch.float64) - 0.5) * 0.4
    return logprobs, old, ref, mask


def direct(logprobs, old, ref, mask, advantages, how, kl_coeff):
    """(loss, d loss / d logprobs) by a loop over tokens."""
    n, total = len(LENGTHS), sum(LENGTHS)
    loss, grad = 0.0, torch.zeros(6, MAX_NEW, dtype=torch.float64)
    for i in range(6):
        for t in range(LENGTHS[i]):
            a = float(advantages[i])
            rho = math.exp(float(logprobs[i, t] - old[i, t]))
            clipped = min(max(rho, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            surrogate = min(rho * a, clipped * a)
            # The min takes the clipped term (a constant) only where it is strictly smaller.
            d = -rho * a if rho * a <= clipped * a else 0.0
            term = -surrogate
            if kl_coeff:
                delta = float(ref[i, t] - logprobs[i, t])
                term += kl_coeff * (math.exp(delta) - delta - 1)
                d += kl_coeff * (1 - math.exp(delta))
            weight = {"sequence_mean": 1 / (n * LENGTHS[i]), "token_mean": 1 / total,
                      "token_sum": 1 / (n * MAX_NEW)}[how]
            loss += weight * term
            grad[i, t] = weight * d
    return loss, grad


@pytest.mark.parametrize("how", ["sequence_mean", "token_mean", "token_sum"])
@pytest.mark.parametrize("kl_coeff", [0.0, 0.05])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_loss_and_gradient_equal_the_direct_computation(how, kl_coeff, normalize_std):
    logprobs, old, ref, mask = batch()
    advantages = group_advantages(REWARDS, normalize_std).flatten()
    # The advantages themselves, by hand: the group's mean (and its sample std).
    for g, rewards in enumerate(REWARDS.tolist()):
        mean = sum(rewards) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 2)
        for j, r in enumerate(rewards):
            expected = (r - mean) / (std + 1e-4) if normalize_std else r - mean
            assert advantages[3 * g + j].item() == pytest.approx(expected, abs=1e-12)
    logprobs.requires_grad_(True)
    parts = token_losses(logprobs, old, advantages, mask, CLIP_LOW, CLIP_HIGH, kl_coeff, ref)
    # Two micro-batches (rows 0-3, 4-5): their shares, normalised by the step's totals, sum to the step's loss.
    loss = sum(aggregate(parts.losses[rows], mask[rows], how, 6, sum(LENGTHS), MAX_NEW)
               for rows in (slice(0, 4), slice(4, 6)))
    loss.backward()
    expected_loss, expected_grad = direct(logprobs.detach(), old, ref, mask, advantages, how, kl_coeff)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=1e-15)
    # Clipping was active on some tokens and not on others (so both branches were checked).
    assert 0 < parts.clipped.sum() < mask.sum()
    assert (parts.kl is not None) == (kl_coeff > 0)


def test_groups_whose_rewards_are_all_equal_are_not_informative():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    assert informative_groups(rewards).tolist() == [False, True, False]
    assert group_advantages(rewards, True)[0].abs().max() == 0


def test_a_kl_term_needs_the_reference_and_an_unknown_aggregation_is_named():
    logprobs, old, _, mask = batch()
    with pytest.raises(ValueError, match="kl_coeff > 0 needs the reference"):
        token_losses(logprobs, old, torch.zeros(6), mask, CLIP_LOW, CLIP_HIGH, 0.1, None)
    with pytest.raises(ValueError, match="rl.loss_aggregation = 'mean' is invalid; valid: sequence_mean"):
        aggregate(logprobs, mask, "mean", 6, 20, MAX_NEW)
