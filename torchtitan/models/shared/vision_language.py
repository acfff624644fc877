"""A decoder that reads images: the seam shared by the vision-language families (Qwen3-VL, Qwen3.5).

    h = embed(tokens);  h[image positions] = tower(patches)         one merged patch per <|image_pad|> token
    for block k:  h = block_k(h, M-RoPE positions);  h[image positions] += deepstack_k   (k < #deepstack)
    logits = output(norm(h))

Images travel per row, so that anything that splits a batch by rows (pipeline micro-batches, data-parallel
shares) splits its images with it:

    pixel_values    (batch, P, patch_dim)   each row's patches, its images one after another, zero-padded to P
    image_grid_thw  (batch, I, 3)           each row's image grids (time, rows, columns in patches), padded with
                                            zero grids, which stand for no image
    image_index     (batch, seq)            for a token that shows an image, the index of its merged patch among
                                            its row's; -1 for every other token (optional: found from the tokens)

``image_index`` is what context parallelism needs: a rank holds only some of a row's tokens, yet the image features
are computed for whole rows before the split, and each token takes its own feature by index. A batch without images
(``pixel_values`` None) runs exactly the text decoder. Positions: (batch, seq, 3) temporal, height and width
positions (``mrope_positions``), or (batch, seq) / None for text, as the text decoder takes them.

A later pipeline stage has no tower (``visual`` None) and no embeddings: it ignores the image inputs, which is why
the DeepStack blocks must sit on the first stage (``image_layers``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.data.config import Chat
from torchtitan.data.image_chat import ImageChat
from torchtitan.config.job_config import Model, Training
from torchtitan.data.images import ImagePatching
from torchtitan.data.shapes import IMAGE_DATASETS
from torchtitan.models.shared.attention import DocumentMask
from torchtitan.models.shared.rope import mrope_streams
from torchtitan.models.shared.vision import VisionTower


def row_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row padded images as the tower takes them: (patches, patch_dim) of all rows in order, the real
    images' grids (images, 3), and each row's number of patches (batch,)."""
    grids = image_grid_thw.reshape(-1, 3)
    sizes = grids.prod(-1)
    per_row = sizes.view(image_grid_thw.shape[:2]).sum(-1)
    if int(per_row.max()) > pixel_values.shape[1]:
        raise ValueError(f"image_grid_thw makes up to {int(per_row.max())} patches in a row, but pixel_values "
                         f"{tuple(pixel_values.shape)} holds {pixel_values.shape[1]} per row")
    real = torch.arange(pixel_values.shape[1], device=pixel_values.device) < per_row.to(pixel_values.device)[:, None]
    return pixel_values[real], grids[sizes > 0], per_row


def config_problems(model: Model, training: Training, args, build_tokenizer) -> list[tuple[str, str]]:
    """(full key, reason) when the data shows images the model cannot read, or a vision-language model could not
    place them: its positions must be M-RoPE's per conversation, and its tokenizer must write <|image_pad|> as the
    model's image token."""
    vision = getattr(args, "vision", None)
    if vision is None:
        if training.dataset_format == "chat" and training.dataset_path is None and training.dataset in IMAGE_DATASETS:
            return [("training.dataset", "holds image conversations, which model.name "
                                         f"{model.name!r} cannot read; use a vision-language model (qwen3_vl, "
                                         "qwen3_5)")]
        return []
    if training.dataset_format != "chat":
        return []
    if model.positions == "global":
        return [("model.positions", "cannot be 'global' for a vision-language model on chat data: it needs M-RoPE "
                                    "positions per conversation (an image's tokens sit on a 2-D grid); valid: "
                                    "'per_document', 'auto'")]
    ids = build_tokenizer(model.hf_assets_path).encode_chat("<|image_pad|>")[0]
    if ids != [args.image_token_id]:
        return [("model.hf_assets_path", f"is a tokenizer that writes <|image_pad|> as {ids}, not as the model's "
                                         f"image token {args.image_token_id}: use the tokenizer of the "
                                         "model (the debug flavors': assets/tokenizer_vision)")]
    return []


def image_chat(args, chat: Chat) -> ImageChat | None:
    """How chat data's images are read for a model with these args (training.chat's image settings and the tower's
    patching); None for a model without a vision tower."""
    vision = getattr(args, "vision", None)
    if vision is None:
        return None
    patching = ImagePatching(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                             merge_size=vision.spatial_merge_size, min_pixels=chat.image_min_pixels,
                             max_pixels=chat.image_max_pixels)
    return ImageChat(patching, args.image_token_id, chat.images_column, chat.messages_column, chat.max_image_tokens)


class ImageScatter(nn.Module):
    """Puts image features at the image tokens' places: replaces the hidden states there, or with ``add`` adds to
    them (DeepStack). A module of its own so that tensor parallelism can give it the whole sequence
    (distributed/tensor_parallel.py): the features are used by every rank, and their gradient must be whole."""

    def __init__(self, add: bool = False):
        super().__init__()
        self.add = add

    def forward(self, h: torch.Tensor, features: torch.Tensor | None, image_mask: torch.Tensor | None,
                gather: torch.Tensor | None) -> torch.Tensor:
        if features is None:
            return h
        placed = features[gather].to(h.dtype)
        return h + torch.where(image_mask[..., None], placed, 0) if self.add else torch.where(
            image_mask[..., None], placed, h)


class VisionLanguageDecoder:
    """Mix into a decoder class (``class Qwen3VL(VisionLanguageDecoder, Decoder)``): adds the vision tower, takes
    images in forward and run_blocks, and reads M-RoPE positions. Its args need ``vision`` (VisionArgs),
    ``mrope_section`` and ``image_token_id``."""

    def __init__(self, args):
        super().__init__(args)
        self.visual = VisionTower(args.vision)
        self.image_scatter, self.deepstack_scatter = ImageScatter(), ImageScatter(add=True)
        self.register_buffer("rope_streams", self._rope_streams(), persistent=False)

    def _rope_streams(self, device: torch.device | None = None) -> torch.Tensor:
        rotary_dim = getattr(self.args, "rotary_dim", None) or self.args.head_dim
        return mrope_streams(self.args.mrope_section, rotary_dim // 2).to(device)

    @property
    def image_layers(self) -> int:
        """How many of the first blocks take image features (DeepStack): they must share the tower's stage."""
        return len(self.args.vision.deepstack_indexes)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                image_index: torch.Tensor | None = None) -> torch.Tensor:
        """As Decoder.forward, with the batch's images (see the module doc)."""
        h = self.run_blocks(tokens, self._documents(document_ids), positions, pixel_values, image_grid_thw,
                            image_index)
        return self.head(h, labels)

    def run_blocks(self, tokens: torch.Tensor, documents: DocumentMask | None = None,
                   positions: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                   image_grid_thw: torch.Tensor | None = None, image_index: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Decoder.run_blocks with the images' tokens in place and DeepStack after the first blocks."""
        features, deepstack, image_mask, gather = None, [], None, None
        if self.embeds_input:  # a later pipeline stage gets hidden states, and has no tower
            h = self.tok_embeddings(tokens)
            if pixel_values is not None:
                features, deepstack, image_mask, gather = self._image_features(tokens, pixel_values,
                                                                               image_grid_thw, image_index)
            h = self.image_scatter(h, features, image_mask, gather)
        else:
            h = tokens
        if positions is not None and positions.dim() == 3:
            positions = positions[..., self.rope_streams]  # a position per frequency
        for k, layer in enumerate(self.main_layers()):
            h = layer(h, self.rope, documents=documents, positions=positions)
            if k < len(deepstack):
                h = self.deepstack_scatter(h, deepstack[k], image_mask, gather)
        return h

    def _image_features(self, tokens: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                        image_index: torch.Tensor | None):
        """The tower's features (merged patches, dim) and DeepStack features of the batch's images, which tokens
        show an image, and for each token the row of the features it takes."""
        patches, grids, per_row = row_images(pixel_values, image_grid_thw)
        features, deepstack = self.visual(patches, grids)
        merged_per_row = (per_row // self.args.vision.merge_unit).to(tokens.device)
        if image_index is None:
            is_image = tokens == self.args.image_token_id
            image_index = torch.where(is_image, is_image.cumsum(-1) - 1, -1)
            if not torch.equal(is_image.sum(-1), merged_per_row):
                raise ValueError(f"the batch's rows have {is_image.sum(-1).tolist()} <|image_pad|> tokens (id "
                                 f"{self.args.image_token_id}) but their images make {merged_per_row.tolist()} "
                                 "merged patches")
        image_mask = image_index >= 0
        row_start = merged_per_row.cumsum(0) - merged_per_row
        # Text tokens gather an appended zero row, which also keeps a tower with no image to show in the graph.
        gather = torch.where(image_mask, row_start[:, None] + image_index, features.shape[0])
        features, *deepstack = (F.pad(t, (0, 0, 0, 1)) for t in (features, *deepstack))
        return features, deepstack, image_mask, gather

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        super().init_weights(seed, buffer_device)
        if self.visual is not None:
            self.visual.init_weights(buffer_device)
        self.rope_streams = self._rope_streams(buffer_device or self.rope_streams.device)
