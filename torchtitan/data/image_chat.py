"""Conversations with images, for the vision-language families: what packing chat data (data/chat.py) needs beyond
text.

A row is a conversation whose messages may show images, and the images themselves:

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                  {"role": "assistant", "content": "red"}],
     "images": ["pictures/0001.png"]}

``images`` (training.chat.images_column) holds, in the order of the {"type": "image"} parts, a path (relative to
the data file's folder), the image's bytes, a {"bytes", "path"} record (a parquet or Arrow image column) or an
image (a Hugging Face ``Image`` feature decodes to one). A row without the column, or a plain list of messages, is a
text conversation. The chat template renders each image part as ``<|vision_start|><|image_pad|><|vision_end|>``;
here the one ``<|image_pad|>`` becomes as many as the image has merged patches (data/images.py makes the patches),
none of them trained, and the conversation's tokens get their M-RoPE positions (``mrope_positions``).

Packing keeps an image whole: a conversation cut to seq_len (training.chat.overlong = "truncate") is cut before
the first image it cannot hold whole, and that image and the ones after it are left out. Bad rows are one line
naming the file and row: an image that cannot be read or fitted, more image parts than images (or fewer), an image
whose tokens alone exceed seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.data.errors import DataError
from torchtitan.data.images import ImagePatching, image_patches, mrope_positions, open_image, pad_row_images

# A conversation's images: each image's patches (patches, patch_dim) and grid (time, rows, columns).
Images = list[tuple[np.ndarray, tuple[int, int, int]]]


@dataclass(frozen=True)
class EncodedImageChat:
    """A conversation ready to pack: inputs and labels as for text, its images and its (tokens, 3) positions."""

    inputs: np.ndarray
    labels: np.ndarray
    images: Images
    positions: np.ndarray

    def cut(self, length: int, image_token_id: int) -> EncodedImageChat:
        """The first ``length`` tokens, or fewer: an image the cut would split is left out with its
        <|vision_start|>."""
        if length < len(self.inputs) and self.inputs[length] == image_token_id:
            while length > 0 and self.inputs[length - 1] == image_token_id:
                length -= 1
            length = max(length - 1, 0)
        is_image = self.inputs[:length] == image_token_id
        kept = int(np.count_nonzero(is_image[1:] & ~is_image[:-1])) + int(is_image[:1].sum())
        return EncodedImageChat(self.inputs[:length], self.labels[:length], self.images[:kept],
                                self.positions[:length])


@dataclass(frozen=True)
class ImageChat:
    """How image conversations are read (from training.chat and the model's vision settings)."""

    patching: ImagePatching
    image_token_id: int
    images_column: str = "images"
    messages_column: str = "messages"
    max_image_tokens: int = 0
    """Image tokens one conversation may hold (0: seq_len); a conversation with more is left out and counted."""

    def split_row(self, row: object, where: str) -> tuple[object, list]:
        """(messages, image sources) of a row: a dict with the messages and images columns, or a list of
        messages (a text conversation)."""
        if not isinstance(row, dict):
            return row, []
        if self.messages_column not in row:
            raise DataError(f"{where}: no column {self.messages_column!r} (columns: {', '.join(sorted(row))}); set "
                            "training.chat.messages_column")
        sources = row.get(self.images_column)
        if sources is None:
            return row[self.messages_column], []
        if not isinstance(sources, (list, tuple)):
            raise DataError(f"{where}: column {self.images_column!r} holds {type(sources).__name__}, not a list of "
                            "images")
        return row[self.messages_column], list(sources)

    def encode(self, inputs: np.ndarray, labels: np.ndarray, sources: list, where: str, folder: Path | None,
               seq_len: int) -> EncodedImageChat:
        """Load the images, expand each <|image_pad|> to the image's merged patches (never trained), and give the
        tokens their positions. DataError for a row whose images do not match its image parts, or cannot be
        read, or whose one image alone is longer than seq_len."""
        pads = np.flatnonzero(inputs == self.image_token_id)
        if len(pads) != len(sources):
            raise DataError(f"{where}: the conversation shows {len(pads)} images ({{'type': 'image'}} parts) but "
                            f"column {self.images_column!r} holds {len(sources)}")
        images: Images = []
        for k, source in enumerate(sources):
            name = f"{where}: image {k}" + (f" ({source})" if isinstance(source, str) else "")
            if isinstance(source, dict):  # a parquet / Arrow image record
                source = source.get("bytes") or source.get("path")
            if isinstance(source, str) and folder is not None and not Path(source).is_absolute():
                source = folder / source
            patches, grid = image_patches(open_image(source, name), self.patching, name)
            tokens = patches.shape[0] // self.patching.merge_size ** 2
            if tokens > seq_len:
                raise DataError(f"{name}: its {grid[1]} x {grid[2]} patches make {tokens} image tokens, more than "
                                f"seq_len {seq_len}; lower training.chat.image_max_pixels (now "
                                f"{self.patching.max_pixels}) or raise training.seq_len")
            images.append((patches, grid))
        counts = [patches.shape[0] // self.patching.merge_size ** 2 for patches, _ in images]
        repeats = np.ones(len(inputs), dtype=np.int64)
        repeats[pads] = counts
        inputs, labels = np.repeat(inputs, repeats), np.repeat(labels, repeats)
        labels[inputs == self.image_token_id] = IGNORE_INDEX  # the token after an image token is never a target
        labels[:-1][inputs[1:] == self.image_token_id] = IGNORE_INDEX
        positions = mrope_positions(inputs.tolist(), [grid for _, grid in images], self.image_token_id,
                                    self.patching.merge_size).numpy()
        return EncodedImageChat(inputs, labels, images, positions)

    def prompt(self, tokenizer, template, messages: list[dict], sources: list, seq_len: int
               ) -> tuple[list[int], Images]:
        """A generation prompt (rendered up to where the assistant answers) showing ``sources``: its token ids,
        each <|image_pad|> expanded, and its images, as the generation engine takes them."""
        from torchtitan.data.chat_template import chat_ids

        ids = np.asarray(chat_ids(tokenizer, template, messages, add_generation_prompt=True), dtype=np.int64)
        encoded = self.encode(ids, np.zeros_like(ids), sources, "prompt", None, seq_len)
        return encoded.inputs.tolist(), encoded.images

    def too_many_image_tokens(self, encoded: EncodedImageChat) -> bool:
        """Over the cap (packing holds the rest to seq_len)."""
        tokens = int(np.count_nonzero(encoded.inputs == self.image_token_id))
        return bool(self.max_image_tokens) and tokens > self.max_image_tokens


class ImageRows:
    """The image fields of one round's rows, filled as conversations are placed."""

    def __init__(self, rows: int, seq_len: int, image_token_id: int):
        self.positions = np.zeros((rows, seq_len, 3), dtype=np.int64)
        self.image_index = np.full((rows, seq_len), -1, dtype=np.int64)
        self.images: list[Images] = [[] for _ in range(rows)]
        self._merged = np.zeros(rows, dtype=np.int64)
        self.image_token_id = image_token_id

    def place(self, row: int, start: int, encoded: EncodedImageChat) -> None:
        end = start + len(encoded.inputs)
        self.positions[row, start:end] = encoded.positions
        is_image = encoded.inputs == self.image_token_id
        index = np.cumsum(is_image) - 1 + self._merged[row]
        self.image_index[row, start:end] = np.where(is_image, index, -1)
        self._merged[row] += int(is_image.sum())
        self.images[row].extend(encoded.images)

    def pad(self, row: int, start: int) -> None:
        """The rest of the row is padding, a document of its own: positions from 0 on all three streams."""
        self.positions[row, start:] = np.arange(self.positions.shape[1] - start)[:, None]

    def fields(self, rows: slice, patch_dim: int) -> tuple[torch.Tensor, ...]:
        """positions (rows, seq, 3), pixel_values, image_grid_thw and image_index of the chosen rows, in `Batch`
        order after the first four fields' positions."""
        pixel_values, grids = pad_row_images([[(torch.from_numpy(p), g) for p, g in row]
                                              for row in self.images[rows]], patch_dim)
        return (torch.from_numpy(self.positions[rows]), pixel_values, grids,
                torch.from_numpy(self.image_index[rows]))
