"""Sampling filters on hand-built logits, and the cache-free reference loop on a stub model."""

import pytest
import torch

from torchtitan.generation import SamplingConfig, choose, filter_top_k, filter_top_p
from torchtitan.generation import generate_without_cache as generate

NEG_INF = float("-inf")


def test_top_k_keeps_the_k_largest_per_row():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0],
                           [0.0, -1.0, 9.0, 8.0, 7.0]])
    out = filter_top_k(logits, 2)
    assert out.tolist() == [[NEG_INF, 5.0, NEG_INF, 4.0, NEG_INF],
                            [NEG_INF, NEG_INF, 9.0, 8.0, NEG_INF]]


def test_top_k_zero_or_at_least_vocab_keeps_everything():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(filter_top_k(logits, 0), logits)
    assert torch.equal(filter_top_k(logits, 3), logits)
    assert torch.equal(filter_top_k(logits, 10), logits)


def test_top_k_keeps_ties_with_the_kth_value():
    out = filter_top_k(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), 2)
    assert out.tolist() == [[3.0, 2.0, 2.0, NEG_INF]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled order)
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    # 0.5 alone does not reach 0.6; 0.5 + 0.3 does: keep exactly those two.
    kept = filter_top_p(logits, 0.6).isfinite()
    assert kept.tolist() == [[False, True, False, True]]
    # p exactly at a cumulative boundary (0.8) needs no third token.
    assert filter_top_p(logits, 0.8).isfinite().tolist() == [[False, True, False, True]]
    assert filter_top_p(logits, 0.81).isfinite().tolist() == [[True, True, False, True]]
    # A tiny p still keeps the most likely token.
    assert filter_top_p(logits, 1e-6).isfinite().tolist() == [[False, True, False, False]]
    assert torch.equal(filter_top_p(logits, 1.0), logits)


def test_top_p_keeps_logit_values_of_survivors():
    logits = torch.tensor([[2.0, 0.0, 1.0]])
    out = filter_top_p(logits, 0.7)
    assert out[0, 0] == 2.0 and out[0, 2] == 1.0 and out[0, 1] == NEG_INF


def test_greedy_picks_argmax_and_sampling_respects_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert choose(logits, SamplingConfig(temperature=0), None)[0].item() == 1
    generator = torch.Generator().manual_seed(0)
    cfg = SamplingConfig(temperature=5.0, top_k=2)
    seen = {choose(logits, cfg, generator)[0].item() for _ in range(200)}
    assert seen == {1, 3}


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("temperature", -0.1), ("top_k", -1),
                                          ("top_p", 0.0), ("top_p", 1.5)])
def test_invalid_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value}).check()


class CountingModel(torch.nn.Module):
    """Always predicts (last token + 1) mod vocab; records the context lengths it was given."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.lengths = vocab, []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.lengths.append(tokens.shape[1])
        return torch.nn.functional.one_hot((tokens + 1) % self.vocab, self.vocab).float() * 10


def test_generate_crops_context_and_stops_at_stop_id():
    model = CountingModel(vocab=8)
    out = generate(model, [1, 2], SamplingConfig(max_new_tokens=4, temperature=0), max_context=3)
    assert out == [3, 4, 5, 6]
    assert model.lengths == [2, 3, 3, 3]
    assert generate(CountingModel(8), [1], SamplingConfig(max_new_tokens=10, temperature=0), max_context=16,
                    stop_id=5) == [2, 3, 4]


def test_same_seed_same_sample():
    model = CountingModel(vocab=50)
    cfg = SamplingConfig(max_new_tokens=20, temperature=100.0, seed=3)
    first = generate(model, [0], cfg, max_context=64)
    assert first == generate(model, [0], cfg, max_context=64)
    assert first != generate(model, [0], SamplingConfig(max_new_tokens=20, temperature=100.0, seed=4), max_context=64)
