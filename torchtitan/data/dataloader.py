"""The stateful dataloader that feeds `Batch` micro-batches (tokens, labels, document ids, positions) to training.

Its state (``state_dict()``, saved per data-parallel rank) is the position in the global token stream
after the last micro-batch it handed out: a document index and a token offset in it (see
torchtitan/data/dataset.py). That position is identical on every rank of a step and independent of
the layout, so ``load_state_dict`` restores the exact next micro-batch, and it does so also under
another data-parallel degree, local batch, accumulation or worker count: the resumed run reads the
stream from the same token, so no token is repeated or skipped. A rank of a new layout may load any
old rank's state (e.g. rank 0's).

torchdata's own snapshot (every worker's iterator state) is not used for this: it is tied to the
worker count and cannot move to another layout, while the stream position can.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.data.chat import PackedChatDataset
from torchtitan.data.config import Chat, Data
from torchtitan.data.dataset import Batch, ImageBatch, PackedTokenDataset, StreamPosition
from torchtitan.data.errors import DataError
from torchtitan.data.image_chat import ImageChat
from torchtitan.data.mixture import MixtureDataset, MixtureSource
from torchtitan.data.shards import TokenShards
from torchtitan.data.sources import load_documents
from torchtitan.data.tokenizer import Tokenizer
from torchtitan.stop_signals import ignore_stop_signals


class TokenDataLoader(StatefulDataLoader):
    """Iterates a rank's `Batch` micro-batches; resumable at any micro-batch (see the module doc).

    Every ``iter()`` starts at the start position: the beginning of the data, or the position given to
    ``load_state_dict``. ``counts`` totals what the dataset reports per round (e.g. conversations
    truncated to fit a sequence) over the micro-batches handed out; it is saved with the position.
    """

    def __init__(self, dataset: PackedTokenDataset | PackedChatDataset, **loader_kwargs):
        with warnings.catch_warnings():
            # torchdata 0.11 calls a torch API that torch now deprecates; the warning is not ours to act on.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            # The dataset yields whole micro-batches: a worker owns a micro-batch, not single windows.
            super().__init__(dataset, batch_size=None, **loader_kwargs)
        self._position = dataset.start
        self.counts: dict[str, int] = {}
        self._start_counts: dict[str, int] = {}
        self.gauges: dict[str, int] = {}
        # A mixture's position is its own type; the single-source datasets' is a StreamPosition.
        self._read_position = getattr(dataset, "position_from_state", StreamPosition.from_state_dict)

    def __iter__(self) -> Iterator[Batch]:
        self._position = self.dataset.start
        self.counts = dict(self._start_counts)
        self.gauges = {}
        return self._batches(super().__iter__())

    def _batches(self, items: Iterator) -> Iterator[Batch]:
        while True:
            try:
                batch, state = next(items)
            except StopIteration:
                return
            except DataError as e:
                error = DataError.from_worker(e)
                # torch's re-raise leaves a cycle (exception -> traceback -> frame -> exception) that keeps
                # the worker iterator alive until the garbage collector finds it, and an iterator collected
                # that way stalls for torch's 5 s join timeout per worker. Clearing the frames breaks it.
                traceback.clear_frames(e.__traceback__)
            else:
                self._position = self._read_position(state["position"])
                for name, count in state.get("counts", {}).items():
                    self.counts[name] = self.counts.get(name, 0) + count
                self.gauges.update(state.get("gauges", {}))
                # A text dataset stacks the fields: one transfer from a worker; an image one sends an ImageBatch.
                yield batch if isinstance(batch, ImageBatch) else Batch(*batch)
                continue
            # Raised outside the except block (no exception context), after dropping the iterator:
            # its workers stop now.
            del items
            self._iterator = None
            raise error

    def metrics(self) -> dict[str, int]:
        """What the data source reports for the metrics: totals (e.g. tokens per mixture source) and the latest
        gauges (e.g. each mixture source's pass over its data)."""
        return {**self.counts, **self.gauges}

    def state_dict(self) -> dict:
        """The stream position after the last micro-batch handed out (layout-independent), and the counts."""
        return {"stream_position": self._position.state_dict(), "counts": dict(self.counts)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Make the next iteration start right after the micro-batch at which state_dict was taken."""
        if "stream_position" not in state_dict:
            raise ValueError(f"dataloader state has keys {sorted(state_dict)}; expected 'stream_position'")
        self.dataset.start = self._position = self._read_position(state_dict["stream_position"])
        self._start_counts = dict(state_dict.get("counts", {}))
        self.counts = dict(self._start_counts)
        self.gauges = {}
        # Persistent workers keep their copy of the dataset; start new ones that see the new position.
        self._iterator = None


def build_dataloader(
    tokenizer: Tokenizer,
    *,
    dataset: str,
    dataset_path: str | None,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    text_column: str = "text",
    split: str = "train",
    infinite: bool = True,
    dataset_format: str = "text",
    chat: Chat | None = None,
    shuffle_seed: int | None = None,
    mixture: Data | None = None,
    global_batch_size: int | None = None,
    image_chat: ImageChat | None = None,
) -> TokenDataLoader:
    """Return a resumable loader of one rank's `Batch` micro-batches, each field [local_batch_size, seq_len].

    dataset_path (local files or a folder) takes precedence over the registered dataset name. With
    ``dataset_format`` "chat" the rows are conversations (column ``chat.messages_column`` of files), packed
    as ``chat`` says (data/chat.py). With "tokens", ``dataset_path`` is a folder of pre-tokenized shards
    (data/shards.py), read in stored order or, given ``shuffle_seed``, in a seeded permutation per pass.
    ``image_chat`` (a vision-language model's) reads chat rows with their images (data/image_chat.py).
    """
    if mixture is not None and mixture.sources:
        packed = build_mixture(tokenizer, mixture, seq_len=seq_len, local_batch_size=local_batch_size,
                               dp_rank=dp_rank, dp_world_size=dp_world_size, split=split,
                               global_batch_size=global_batch_size or local_batch_size * dp_world_size,
                               shuffle_seed=shuffle_seed)
        return _loader(packed, num_workers, pin_memory, prefetch_factor, persistent_workers)
    label = repr(dataset_path if dataset_path is not None else dataset)
    layout = dict(seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
                  infinite=infinite, label=label)
    if dataset_format == "chat":
        chat = chat or Chat()
        conversations = load_documents(dataset, dataset_path, split, chat.messages_column, "chat",
                                       whole_rows=image_chat is not None)
        packed = PackedChatDataset(conversations, tokenizer, train_on=chat.train_on, overlong=chat.overlong,
                                   images=image_chat, **layout)
    elif dataset_format == "tokens":
        if dataset_path is None:
            raise DataError("dataset_format 'tokens' reads dataset_path, a folder made by scripts/tokenize_dataset.py; "
                            "none is set")
        shards = TokenShards(dataset_path, tokenizer, shuffle_seed)
        packed = PackedTokenDataset(shards, tokenizer, **layout)
    elif dataset_format == "text":
        packed = PackedTokenDataset(load_documents(dataset, dataset_path, split, text_column), tokenizer, **layout)
    else:
        raise ValueError(f"dataset_format {dataset_format!r} is not one of text, chat, tokens")
    return _loader(packed, num_workers, pin_memory, prefetch_factor, persistent_workers)


def _loader(packed, num_workers: int, pin_memory: bool, prefetch_factor: int | None,
            persistent_workers: bool) -> TokenDataLoader:
    return TokenDataLoader(
        packed,
        num_workers=num_workers,
        # A preemption signal is for the training process to act on; workers must outlive it.
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


def build_mixture(tokenizer: Tokenizer, data: Data, *, seq_len: int, local_batch_size: int, dp_rank: int,
                  dp_world_size: int, split: str, global_batch_size: int,
                  shuffle_seed: int | None = None) -> MixtureDataset:
    """The [data] section's sources and stages as one rank's MixtureDataset (data/mixture.py)."""
    sources = []
    for i, source in enumerate(data.sources):
        name = source.name or f"source{i}"
        if source.kind == "tokens":
            if source.path is None:
                raise DataError(f"data.sources[{i}] ({name}): kind 'tokens' needs a path (a shard folder)")
            documents = TokenShards(source.path, tokenizer, shuffle_seed)
        else:
            documents = load_documents(source.dataset, source.path, split)
        sources.append(MixtureSource(name, documents))
    stages = [(0, [source.weight for source in data.sources])]
    for stage in data.stages:
        first = (stage.start_step - 1) * global_batch_size
        stages = [s for s in stages if s[0] < first] + [(first, list(stage.weights))]
    return MixtureDataset(sources, stages, tokenizer, seq_len, local_batch_size, dp_rank, dp_world_size,
                          repeat=data.on_exhausted == "repeat")
