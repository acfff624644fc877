"""Packing documents into one global stream of training windows, and each rank's (and worker's) share of it.

The stream: every non-empty document becomes BOS + tokens + EOS, documents follow each other in
order, and the token sequence is cut into windows of seq_len + 1 tokens where window i covers tokens
[i * seq_len, (i + 1) * seq_len]: each window starts on the last token of the previous one, so every
adjacent pair of tokens is trained on exactly once. A window gives input_ids = w[:-1], labels = w[1:].

Layout independence: a data-parallel rank's micro-batch takes the next local_batch x dp windows of the
stream (a "round"), rank r keeping windows r, r + dp, r + 2 dp, ... of it. The union over ranks of a
step's micro-batches is therefore the next global_batch windows of the one stream, whatever the
data-parallel degree, local batch and accumulation: every layout trains on the same sequences at
every step. Every rank (and every dataloader worker) tokenizes the whole stream to know where windows
fall, and materialises only its own.

Dataloader workers: worker w of W produces the rank's micro-batches w, w + W, w + 2W, ... counted from
where the iteration starts, which is the order torch's loader asks its workers in, so the workers'
shares are disjoint and interleave back into the single-process order.

Resuming: the stream position after a micro-batch is a document and a token in it (`StreamPosition`);
it is the same on every rank and means the same thing under any layout, so a run resumed from it with
another data-parallel degree, batch size or worker count continues with no token repeated or skipped.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.data.errors import DataError
from torchtitan.data.tokenizer import Tokenizer
from torchtitan.log import logger

# Documents tokenized per call: enough for the tokenizer to work in parallel, little enough to stay close
# to where the consumer is.
_DOCUMENTS_PER_ENCODE = 64


@dataclass(frozen=True)
class StreamPosition:
    """A token of the stream: token `offset` (0 = its BOS) of document `document` in pass `epoch` over the data."""

    epoch: int = 0
    document: int = 0
    offset: int = 0

    def state_dict(self) -> dict:
        """The position as plain ints (for checkpoints)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> StreamPosition:
        """Read a position written by state_dict."""
        fields = set(asdict(cls()))
        if set(state) != fields or not all(isinstance(v, int) and v >= 0 for v in state.values()):
            raise ValueError(f"invalid stream position {state!r}; expected non-negative ints {sorted(fields)}")
        return cls(**state)


IGNORE_INDEX = -100
"""The label of a position that trains nothing (a loss mask, the end of a row): cross-entropy skips it."""


class Batch(NamedTuple):
    """One micro-batch, every field [local_batch_size, seq_len]: the tokens, their next-token labels
    (IGNORE_INDEX where nothing is trained), and for each token its document within the row and its
    position within that document (see `document_ids` and `document_positions`)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in self))


class ImageBatch(NamedTuple):
    """A `Batch` of image conversations (data/image_chat.py): its positions are M-RoPE's [local_batch_size,
    seq_len, 3], and the rows' images come in the per-row layout of models/shared/vision_language.py:
    ``pixel_values`` [local_batch_size, P, patch_dim], ``image_grid_thw`` [local_batch_size, I, 3] and
    ``image_index`` [local_batch_size, seq_len]. The sequence is dimension 1 of every per-token field."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_index: torch.Tensor

    def to(self, device: torch.device) -> ImageBatch:
        return ImageBatch(*(t.to(device, non_blocking=True) for t in self))

    def per_token(self) -> dict[str, torch.Tensor]:
        """The per-token image fields (context parallelism splits them with the tokens)."""
        return {"image_index": self.image_index}

    def per_row(self) -> dict[str, torch.Tensor]:
        """The per-row image fields (context parallelism leaves them whole: images are computed before the sequence
        is split)."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def document_ids(input_ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Index of each token's document within its row (0 = the row's first), for attention that masks across documents.

    Documents start at BOS, and BOS never comes from text (the tokenizers encode special-token strings
    as text), so two tokens belong to the same document exactly when their ids here are equal.
    """
    starts = (input_ids == bos_id).cumsum(-1)
    return starts - starts[..., :1]


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, counted from the document's first token in the row.

    A document cut by the start of the row (it began in the previous window) counts from 0 there: the row
    is all the model sees of it. ``document_ids`` must not decrease along a row (packing never revisits a
    document).
    """
    index = torch.arange(document_ids.size(-1), device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def stacked_batch(inputs: np.ndarray, labels: np.ndarray, ids: np.ndarray | None = None,
                  bos_id: int | None = None) -> torch.Tensor:
    """The `Batch` fields stacked in one (4, batch, seq_len) tensor: one transfer from a dataloader worker
    instead of four. Document ids are ``ids``, or found from BOS (`document_ids`); positions follow from them
    (`document_positions`). Computed in numpy: per batch, torch's small-op overhead would cost more than the
    arithmetic."""
    out = np.empty((4, *inputs.shape), dtype=np.int64)
    out[0], out[1] = inputs, labels
    ids_out, positions = out[2], out[3]
    if ids is None:
        np.cumsum(inputs == bos_id, axis=-1, out=ids_out)
        ids_out -= ids_out[:, :1]
    else:
        ids_out[:] = ids
    ids = ids_out
    index = np.arange(inputs.shape[1])
    first = np.ones(ids.shape, dtype=bool)
    np.not_equal(ids[:, 1:], ids[:, :-1], out=first[:, 1:])
    np.maximum.accumulate(np.where(first, index, 0), axis=1, out=positions)
    np.subtract(index, positions, out=positions)
    return torch.from_numpy(out)


def text_batch(windows: np.ndarray, bos_id: int) -> torch.Tensor:
    """The stacked micro-batch of packed windows of seq_len + 1 tokens: inputs w[:-1], labels w[1:]."""
    return stacked_batch(windows[:, :-1], windows[:, 1:], bos_id=bos_id)


class _TokenStream:
    """The packed token stream from a position on, read in windows."""

    def __init__(self, documents: Iterable[str], tokenizer: Tokenizer, start: StreamPosition, infinite: bool,
                 label: str, log_epochs: bool):
        self._documents = documents
        self._tokenizer = tokenizer
        self._infinite = infinite
        self._label = label
        self._log_epochs = log_epochs
        self._start = start
        # Tokenized documents not yet consumed: [epoch, document, offset of tokens[0], tokens].
        self._chunks: collections.deque[list] = collections.deque()
        self._buffered = 0
        self._pending = self._tokenized(start)

    def position(self) -> StreamPosition:
        """The position of the next token to be read (after a window, the first token of the next one)."""
        if self._chunks:
            epoch, document, offset, _ = self._chunks[0]
            return StreamPosition(epoch, document, offset)
        return self._start

    def _encode(self, batch: list[tuple[int, object]]) -> list[tuple[int, np.ndarray]]:
        if all(isinstance(document, np.ndarray) for _, document in batch):
            return batch  # pre-tokenized (data/shards.py): BOS + ids + EOS already, no empty documents
        texts = []
        for index, text in batch:
            if not isinstance(text, str):
                raise DataError(f"dataset {self._label}: row {index} is {type(text).__name__}, not text")
            if text.strip():  # empty documents would add nothing but a BOS/EOS pair
                texts.append((index, text))
        encoded = self._tokenizer.encode_batch([text for _, text in texts], bos=True, eos=True)
        return [(index, np.asarray(ids, dtype=np.int64)) for (index, _), ids in zip(texts, encoded)]

    def _tokenized(self, start: StreamPosition) -> Iterator[list]:
        epoch, first = start.epoch, start.document
        while True:
            produced = False
            if hasattr(self._documents, "iter_from"):  # random access (shards): resume without reading up to it
                rows = enumerate(self._documents.iter_from(first, epoch), start=first)
            else:
                rows = itertools.islice(enumerate(self._documents), first, None)
            while batch := list(itertools.islice(rows, _DOCUMENTS_PER_ENCODE)):
                for index, tokens in self._encode(batch):
                    offset = start.offset if (epoch, index) == (start.epoch, start.document) else 0
                    produced = True
                    # A position saved with another tokenizer may lie past the document's end: never yield
                    # an empty chunk.
                    if offset < len(tokens):
                        yield [epoch, index, offset, tokens[offset:]]
            if not self._infinite:
                return
            if first == 0 and not produced:
                raise DataError(f"dataset {self._label} has no non-empty documents; cannot cycle through it")
            if self._log_epochs:
                logger.info(f"dataset {self._label}: pass {epoch} over the data is done; starting pass {epoch + 1}")
            epoch, first = epoch + 1, 0

    def window(self, n: int) -> np.ndarray | None:
        """The next n + 1 tokens, consuming n (the last one starts the next window); None at the end of the data."""
        while self._buffered < n + 1:
            chunk = next(self._pending, None)
            if chunk is None:
                return None
            self._chunks.append(chunk)
            self._buffered += len(chunk[3])
        pieces, needed = [], n + 1
        for chunk in self._chunks:
            pieces.append(chunk[3][:needed])
            needed -= len(pieces[-1])
            if needed == 0:
                break
        to_consume = n
        while to_consume:
            chunk = self._chunks[0]
            step = min(to_consume, len(chunk[3]))
            chunk[2] += step
            chunk[3] = chunk[3][step:]
            to_consume -= step
            if not len(chunk[3]):
                self._chunks.popleft()
        self._buffered -= n
        return np.concatenate(pieces)


class PackedTokenDataset(IterableDataset):
    """One data-parallel rank's micro-batches of the global window stream (see the module doc).

    Yields ``(batch, state)``: the `Batch` fields stacked in one LongTensor (4, local_batch_size, seq_len)
    and ``{"position": the StreamPosition state after the whole round}``, identical on every rank. With
    ``infinite=False`` the data is read once and a trailing partial round is dropped, so every rank yields the
    same number of micro-batches; otherwise the stream starts over from the first document after the last (next
    pass). ``documents`` may also be pre-tokenized arrays (data/shards.py), read from the position on directly.
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int = 1,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        label: str = "documents",
    ):
        if iter(documents) is documents:
            raise TypeError("documents must be re-iterable (e.g. a list), not a one-shot iterator")
        for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(
                f"dp_rank must be in [0, {dp_world_size}) for dp_world_size={dp_world_size}, got {dp_rank}"
            )
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.label = label
        self.start = StreamPosition()
        # Token offsets, within a round, of this rank's windows: row m is window m * dp + dp_rank.
        rows = np.arange(local_batch_size)[:, None] * dp_world_size + dp_rank
        self._window_index = rows * seq_len + np.arange(seq_len + 1)[None, :]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict]]:
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        stream = _TokenStream(self.documents, self.tokenizer, self.start, self.infinite, self.label,
                              log_epochs=worker_id == 0)
        round_tokens = self.local_batch_size * self.dp_world_size * self.seq_len
        for step in itertools.count():
            tokens = stream.window(round_tokens)
            if tokens is None:
                return
            if step % num_workers == worker_id:
                batch = text_batch(tokens[self._window_index], self.tokenizer.bos_id)
                yield batch, {"position": stream.position().state_dict()}
