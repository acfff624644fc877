"""Generation without a cache: every new token runs the whole (cropped) context through the model again.

O(n^2) work over a generation; kept as the reference the engine is tested against token for token, and as the
baseline benchmarks/generation.py measures it against. Use GenerationEngine (engine.py) for anything else.
"""

import torch
from torch import nn

from torchtitan.generation.sampling import SamplingConfig, choose


@torch.no_grad()
def generate_without_cache(model: nn.Module, prompt_ids: list[int], cfg: SamplingConfig, *, max_context: int,
                           stop_id: int | None = None, device: torch.device | str = "cpu") -> list[int]:
    """The new token ids after ``prompt_ids`` (not including the prompt), stopping early at ``stop_id``.

    ``max_context`` is the longest sequence the model was built for (its RoPE table); older tokens are cropped from
    the left once the text grows past it.
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
        chosen, _ = choose(logits, cfg, generator)
        token_id = int(chosen.item())
        if token_id == stop_id:
            break
        new_ids.append(token_id)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
    return new_ids
