"""Sampling text from a trained model: temperature, top-k and top-p (nucleus) filtering.

The model has no key/value cache, so every new token runs the whole (cropped) context through the
model again. That costs O(n^2) work over a generation, which is fine for the short samples this is
meant for: checking that a checkpoint learned something, not serving.
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingConfig:
    """How to choose each next token. temperature 0 means greedy (always the most likely token)."""

    max_new_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1.0 keeps every token
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens} is invalid; it must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature} is invalid; it must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} is invalid; it must be >= 0 (0 = no top-k filtering)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} is invalid; it must be in (0, 1] (1 = no top-p filtering)")


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits with everything below the k-th largest (per row) set to -inf; k = 0 keeps all.

    Ties with the k-th value are kept, so a row may keep more than k tokens.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Logits outside the nucleus set to -inf: the fewest most-likely tokens whose probability reaches p.

    The most likely token is always kept, so the result is never all -inf.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # A token is dropped when the tokens ranked above it already reach p.
    mass_before = cumulative - sorted_logits.softmax(dim=-1)
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``logits`` ([batch, vocab]) -> [batch, 1]."""
    logits = logits.float()
    if cfg.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = filter_top_p(filter_top_k(logits / cfg.temperature, cfg.top_k), cfg.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    cfg: SamplingConfig,
    *,
    max_context: int,
    stop_id: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """The new token ids after ``prompt_ids`` (not including the prompt), stopping early at ``stop_id``.

    ``max_context`` is the longest sequence the model was built for (its RoPE table); older tokens
    are cropped from the left once the text grows past it.
    """
    cfg.check()
    if not prompt_ids:
        raise ValueError("the prompt is empty; it needs at least one token (e.g. BOS)")
    # The generator lives on the sampling device so a seed gives the same text on every run there.
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new_ids: list[int] = []
    for _ in range(cfg.max_new_tokens):
        logits = model(tokens[:, -max_context:])[:, -1, :]
        chosen = next_token(logits, cfg, generator)
        token_id = int(chosen.item())
        if token_id == stop_id:
            break
        new_ids.append(token_id)
        tokens = torch.cat([tokens, chosen], dim=1)
    return new_ids
