"""Qwen3-VL: the shared decoder reading images through the vision tower.

    h = embed(tokens);  h[image positions] = tower(patches)         one merged patch per <|image_pad|> token
    for block k:  h = block_k(h, M-RoPE positions);  h[image positions] += deepstack_k   (k < #deepstack)
    logits = output(norm(h))

A batch without images (``pixel_values`` None) runs exactly the text decoder. Positions: (batch, seq, 3) temporal,
height and width positions (``mrope_positions``), or (batch, seq) / None for text, as the text decoder takes them.
"""

from __future__ import annotations

import torch

from torchtitan.models.qwen3_vl.args import Qwen3VLModelArgs
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.decoder import Decoder
from torchtitan.models.shared.rope import mrope_streams
from torchtitan.models.shared.vision import VisionTower


class Qwen3VL(Decoder):
    def __init__(self, args: Qwen3VLModelArgs):
        super().__init__(args)
        self.visual = VisionTower(args.vision)
        self.register_buffer("rope_streams", mrope_streams(args.mrope_section, args.head_dim // 2),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """As Decoder.forward, with the patches of the batch's images (pixel_values: (patches, patch_dim), in the
        order their <|image_pad|> runs appear, row by row) and their grids (image_grid_thw: (images, 3))."""
        h = self.run_blocks(tokens, self._documents(document_ids), positions, pixel_values, image_grid_thw)
        return self.head(h, labels)

    def run_blocks(self, tokens: torch.Tensor, documents: DocumentMask | None = None,
                   positions: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                   image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder.run_blocks with the images' tokens in place and DeepStack after the first blocks."""
        h, image_mask, deepstack = self.embed(tokens, pixel_values, image_grid_thw)
        if positions is not None and positions.dim() == 3:
            positions = positions[..., self.rope_streams]  # a position per frequency
        for k, layer in enumerate(self.main_layers()):
            h = layer(h, self.rope, documents=documents, positions=positions)
            if k < len(deepstack):
                h = h.masked_scatter(image_mask[..., None], h[image_mask] + deepstack[k].to(h.dtype))
        return h

    def embed(self, tokens: torch.Tensor, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """The token embeddings with the images' tokens in place, the image positions' mask and the DeepStack
        features."""
        h = self.tok_embeddings(tokens) if self.embeds_input else tokens  # a later pipeline stage gets hidden states
        if pixel_values is None:
            return h, None, []
        features, deepstack = self.visual(pixel_values, image_grid_thw)
        image_mask = tokens == self.args.image_token_id
        if int(image_mask.sum()) != features.shape[0]:
            raise ValueError(f"the batch has {int(image_mask.sum())} <|image_pad|> tokens (id "
                             f"{self.args.image_token_id}) but its images make {features.shape[0]} merged patches")
        h = h.masked_scatter(image_mask[..., None], features.to(h.dtype))
        return h, image_mask, deepstack

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        super().init_weights(seed, buffer_device)
        self.visual.init_weights(buffer_device)
        self.rope_streams = mrope_streams(self.args.mrope_section, self.args.head_dim // 2).to(
            buffer_device or self.rope_streams.device)


def mrope_positions(tokens: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                    spatial_merge_size: int, start: int = 0) -> torch.Tensor:
    """The (len(tokens), 3) temporal/height/width positions of one document: a text token takes the next position
    on all three streams; a run of <|image_pad|> tokens is the next image of ``grids`` (t, h, w in patches), its
    merged patches at (start, start + row, start + column) from the position after the text before it, and the
    text after it continues from start + max(rows, columns)."""
    out = torch.empty(len(tokens), 3, dtype=torch.long)
    images = iter(grids)
    position, i = start, 0
    while i < len(tokens):
        if tokens[i] != image_token_id:
            out[i] = position
            position, i = position + 1, i + 1
            continue
        try:
            t, h, w = next(images)
        except StopIteration:
            raise ValueError(f"token {i} starts an image, but the document's {len(grids)} image grids are "
                             "used up") from None
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        n = t * rows * cols
        if tokens[i:i + n] != [image_token_id] * n:
            raise ValueError(f"the image at token {i} has {n} merged patches, but the run of image tokens there "
                             "is shorter")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij"),
                           dim=-1).reshape(-1, 3)
        out[i:i + n] = grid + position
        position, i = position + max(rows, cols), i + n
    return out
