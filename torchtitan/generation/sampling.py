"""How each next token is chosen from the model's logits: greedy, or sampled after temperature, top-k and top-p
(nucleus) filtering; and the log-probability reported for it.

The log-probability of a sampled token is taken from the distribution it was drawn from: log_softmax of the
processed logits (``processed_logits``: divided by the temperature, then top-k and top-p filtered, which renormalises
over the kept tokens). A trainer that wants the same numbers applies ``processed_logits`` to its own logits (the RL
objective does). Greedy decoding (temperature 0) has no sampling distribution: its log-probability is under the
model's own one (temperature 1, nothing filtered).
"""

from dataclasses import dataclass

import torch


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


def processed_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The float32 logits each token is drawn from: divided by the temperature, top-k then top-p filtered (-inf
    outside); greedy (temperature 0) leaves them as the model gave them."""
    logits = logits.float()
    if cfg.temperature == 0:
        return logits
    return filter_top_p(filter_top_k(logits / cfg.temperature, cfg.top_k), cfg.top_p)


def choose(logits: torch.Tensor, cfg: SamplingConfig,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids (batch,), their log-probabilities (batch,), float32) for logits (batch, vocab)."""
    processed = processed_logits(logits, cfg)
    log_probs = processed.log_softmax(dim=-1)
    if cfg.temperature == 0:
        tokens = processed.argmax(dim=-1)
    else:
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
