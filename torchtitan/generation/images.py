"""Prompts that show images, for a vision-language model (models/shared/vision_language.py) in the engine.

A prompt's images are its <|image_pad|> runs' pictures, in order, each as (patches, grid) from data/images.py; the
prompt already holds one <|image_pad|> per merged patch (data/image_chat.py expands them). For a batch of rows:

- positions are M-RoPE's (rows, slots, 3): a row's left padding at 0, its prompt as ``mrope_positions`` gives it,
  and every generated token one further on all three streams, from one past the prompt's largest position (where
  transformers' generation continues too);
- the images go with every prefill chunk that shows some of them: the tower runs on the rows' images and each image
  token takes its feature by index, so an image cut by a chunk boundary is still placed whole. Decode steps show
  none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchtitan.data.images import mrope_positions, pad_row_images

Images = list[tuple[np.ndarray | torch.Tensor, tuple[int, int, int]]]


def check_prompt_images(model, prompts: Sequence[Sequence[int]], images: Sequence[Images]) -> None:
    """ValueError (one line, naming the prompt) unless the model reads images and each prompt's image tokens are
    its images' merged patches."""
    if not hasattr(model, "visual"):
        raise ValueError(f"images were given, but {type(model).__name__} has no vision tower; use a vision-language "
                         "model (model.name qwen3_vl or qwen3_5)")
    if len(images) != len(prompts):
        raise ValueError(f"images holds {len(images)} lists for {len(prompts)} prompts; give one list per prompt")
    token, merge = model.args.image_token_id, model.args.vision.spatial_merge_size
    for i, (prompt, shown) in enumerate(zip(prompts, images)):
        tokens = sum(1 for t in prompt if t == token)
        merged = sum(t * h * w // merge ** 2 for _, (t, h, w) in shown)
        if tokens != merged:
            raise ValueError(f"prompt {i} has {tokens} image tokens (id {token}) but its {len(shown)} images make "
                             f"{merged} merged patches")


class GroupImages:
    """The image inputs of one batch of left-padded rows (see the module doc)."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], images: Sequence[Images], capacity: int,
                 device: torch.device):
        token, merge = model.args.image_token_id, model.args.vision.spatial_merge_size
        longest = max(map(len, prompts))
        table = torch.zeros(len(prompts), capacity, 3, dtype=torch.long)
        index = torch.full((len(prompts), longest), -1, dtype=torch.long)
        for b, (prompt, shown) in enumerate(zip(prompts, images)):
            start = longest - len(prompt)
            positions = mrope_positions(list(prompt), [grid for _, grid in shown], token, merge)
            table[b, start:longest] = positions
            table[b, longest:] = (positions.max() + 1 + torch.arange(capacity - longest))[:, None]
            is_image = torch.tensor(list(prompt)) == token
            index[b, start:] = torch.where(is_image, is_image.cumsum(0) - 1, -1)
        patch_dim = model.args.vision.patch_dim
        pixel_values, grids = pad_row_images([[(torch.as_tensor(p), g) for p, g in shown] for shown in images],
                                             patch_dim)
        self.position_table = table.to(device)
        self.image_index = index.to(device)
        self.pixel_values = pixel_values.to(device, next(model.parameters()).dtype)
        self.image_grid_thw = grids.to(device)

    def prefill_inputs(self, slot0: int, end: int) -> dict[str, torch.Tensor]:
        """run_blocks' image inputs for the prompt slots [slot0, end): none where the chunk shows no image."""
        index = self.image_index[:, slot0:end]
        if not (index >= 0).any():
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw, "image_index": index}
