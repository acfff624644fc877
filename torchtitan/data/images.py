"""Images to the vision tower's patches (models/shared/vision.py), as Qwen2-VL's image processor makes them, which
Qwen3-VL and Qwen3.5 use: Pillow and NumPy only (no torchvision).

1. RGB: transparency is composited onto white (a transparent pixel would otherwise show its arbitrary colour).
2. Resize (bicubic) so that both sides are multiples of ``factor`` = patch_size x merge_size, the aspect ratio kept
   as closely as possible and the pixel count within [min_pixels, max_pixels] (``fit_to_grid``).
3. Scale to [0, 1], then normalise each channel with ``mean`` and ``std``.
4. Cut into patch_size x patch_size patches, each repeated temporal_patch_size times (the tower also reads video)
   and flattened as (channel, time, row, column), the patches of each merge_size x merge_size block consecutive
   (merge-block order), which is how the tower and its merger read them.

And the multimodal RoPE positions of a document with images (``mrope_positions``), and a batch's images in the
per-row layout the vision-language decoders take (``pad_row_images``; models/shared/vision_language.py).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from torchtitan.data.errors import DataError

# The widest aspect ratio the resize accepts (Qwen2-VL's processor refuses wider ones too).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImagePatching:
    """How images become patches; the defaults are Qwen3-VL's and Qwen3.5's released processor settings."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merge block, in pixels)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2


def fit_to_grid(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: each side rounded to a multiple of ``factor``; when that leaves
    more than ``max_pixels`` (fewer than ``min_pixels``), both sides scaled by the same ratio first and rounded
    down (up). ValueError for an aspect ratio above MAX_ASPECT_RATIO or a result under one block of patches."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"its aspect ratio {max(height, width) / min(height, width):.0f} is above "
                         f"{MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    if min(h, w) < factor:
        raise ValueError(f"it resizes to {w} x {h} pixels, too small for one {factor} x {factor} block of patches; "
                         f"raise min_pixels (now {min_pixels}) to at least {factor * factor}")
    return h, w


def open_image(source: str | Path | bytes | Image.Image, where: str = "") -> Image.Image:
    """An RGB image from a file, its bytes or a PIL image, transparency composited onto white; DataError (one line,
    naming ``where`` and the file) for a missing or unreadable one."""
    name = where or (str(source) if isinstance(source, (str, Path)) else "image")
    try:
        if isinstance(source, Image.Image):
            image = source
        else:
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            image.load()
    except FileNotFoundError:
        raise DataError(f"{name}: no such image file") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{name}: not a readable image ({type(e).__name__}: {e})") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def image_patches(image: Image.Image, patching: ImagePatching = ImagePatching(), where: str = ""
                  ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The patches (patches, patch_dim) float32 of an RGB image, in merge-block order, and its grid (1, rows,
    columns) in patches. DataError naming ``where`` for an image that cannot be fitted."""
    p = patching
    try:
        height, width = fit_to_grid(image.height, image.width, p.factor, p.min_pixels, p.max_pixels)
    except ValueError as e:
        raise DataError(f"{where or 'image'} ({image.width} x {image.height} pixels): {e}") from None
    resized = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))  # (height, width, 3) uint8
    pixels = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    pixels = (pixels - np.array(p.mean, dtype=np.float32)) / np.array(p.std, dtype=np.float32)
    rows, cols, m, s = height // p.patch_size, width // p.patch_size, p.merge_size, p.patch_size
    blocks = pixels.transpose(2, 0, 1).reshape(3, rows // m, m, s, cols // m, m, s)
    # -> (block row, block column, row in block, column in block, channel, pixel row, pixel column)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], p.temporal_patch_size, s, s))
    return np.ascontiguousarray(patches).reshape(rows * cols, p.patch_dim), (1, rows, cols)


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


def pad_row_images(rows: list[list[tuple[torch.Tensor, tuple[int, int, int]]]], patch_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's images as (patches, grid) pairs -> pixel_values (rows, P, patch_dim) and image_grid_thw
    (rows, I, 3), zero-padded to the most patches and images of a row (a zero grid is no image)."""
    most_patches = max((sum(len(p) for p, _ in row) for row in rows), default=0)
    most_images = max(map(len, rows), default=0)
    pixels = torch.zeros(len(rows), most_patches, patch_dim)
    grids = torch.zeros(len(rows), most_images, 3, dtype=torch.long)
    for r, row in enumerate(rows):
        if row:
            patches = torch.cat([torch.as_tensor(p, dtype=torch.float32) for p, _ in row])
            pixels[r, :len(patches)] = patches
            grids[r, :len(row)] = torch.tensor([grid for _, grid in row])
    return pixels, grids
