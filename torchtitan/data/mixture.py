"""A weighted mixture of data sources, in stages: which source each sequence of the global stream comes from.

Each source is its own packed stream of windows (data/dataset.py: text tokenized on the fly, or pre-tokenized
shards). The global stream of sequences interleaves them by weight, deterministically: sequence n of a stage
comes from the source that is furthest behind its share, i.e. maximises ``w_s * (n + 1) - c_s`` (``c_s``: its
sequences so far in the stage; ties to the first source). Every source's count then stays within about one
sequence of ``n * w_s`` after every prefix, so any run of 1,000 consecutive sequences holds each source within
a few tenths of a percentage point of its weight. Stages switch the weights at given steps: step k trains on
global sequences [(k - 1) G, k G) for global batch G, so the new weights apply from step k exactly, with fresh
counts.

Layout independence and resuming work as for one source: a rank's micro-batch takes rows r, r + dp, ... of
the next local_batch x dp sequences (a round); the position after a round is every source's stream position,
the global sequence index and the stage's counts, the same on every rank and under any layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.data.dataset import StreamPosition, _TokenStream, text_batch
from torchtitan.data.errors import DataError
from torchtitan.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class MixturePosition:
    """Where a mixture stands: the next global sequence, the current stage's counts per source, and each
    source's stream position."""

    sequence: int = 0
    stage_counts: tuple[int, ...] = ()
    sources: tuple[StreamPosition, ...] = ()
    names: tuple[str, ...] = ()

    def state_dict(self) -> dict:
        return {"sequence": self.sequence, "stage_counts": list(self.stage_counts),
                "sources": [p.state_dict() for p in self.sources], "names": list(self.names)}

    @classmethod
    def from_state_dict(cls, state: dict) -> MixturePosition:
        if set(state) != {"sequence", "stage_counts", "sources", "names"}:
            raise ValueError(f"invalid mixture position {state!r}; expected sequence, stage_counts, sources, names")
        return cls(state["sequence"], tuple(state["stage_counts"]),
                   tuple(StreamPosition.from_state_dict(p) for p in state["sources"]), tuple(state["names"]))


@dataclass
class Stage:
    first_sequence: int
    weights: np.ndarray  # normalised


@dataclass
class MixtureSource:
    name: str
    documents: Iterable = field(repr=False)


def pick_sources(weights: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """The sources of the next ``n`` sequences of a stage whose counts so far are ``counts`` (updated in place)."""
    picked = np.empty(n, dtype=np.int64)
    for i in range(n):
        s = int(np.argmax(weights * (counts.sum() + 1) - counts))
        counts[s] += 1
        picked[i] = s
    return picked


class MixtureDataset(IterableDataset):
    """One data-parallel rank's micro-batches of a staged mixture (see the module doc).

    ``stages``: (first global sequence, weights) sorted, the first at sequence 0. Yields ``(batch, state)`` like
    PackedTokenDataset, with ``state["counts"]`` holding each source's tokens of the round (``tokens/NAME``) and
    ``state["gauges"]`` each source's pass over its data (``epoch/NAME``).
    """

    def __init__(self, sources: list[MixtureSource], stages: list[tuple[int, list[float]]], tokenizer: Tokenizer,
                 seq_len: int, local_batch_size: int = 1, dp_rank: int = 0, dp_world_size: int = 1,
                 repeat: bool = True):
        if not sources:
            raise ValueError("a mixture needs at least one source")
        self.sources, self.tokenizer, self.seq_len = sources, tokenizer, seq_len
        self.local_batch_size, self.dp_rank, self.dp_world_size, self.repeat = (
            local_batch_size, dp_rank, dp_world_size, repeat)
        self.stages = []
        for first, weights in stages:
            w = np.asarray(weights, dtype=np.float64)
            if len(w) != len(sources) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
                raise ValueError(f"stage from sequence {first}: weights {list(weights)} must be {len(sources)} "
                                 "non-negative numbers with a positive sum")
            self.stages.append(Stage(first, w / w.sum()))
        if not self.stages or self.stages[0].first_sequence != 0:
            raise ValueError("the first stage must start at sequence 0")
        self.names = tuple(source.name for source in sources)
        self.start = MixturePosition(0, (0,) * len(sources), (StreamPosition(),) * len(sources), self.names)

    def position_from_state(self, state: dict) -> MixturePosition:
        position = MixturePosition.from_state_dict(state)
        if position.names != self.names:
            raise DataError(f"the checkpoint's data position is for the sources {list(position.names)}, not the "
                            f"configured {list(self.names)}; a mixture resumes only with the same sources in order")
        return position

    def _stage_at(self, sequence: int) -> int:
        return max(i for i, stage in enumerate(self.stages) if stage.first_sequence <= sequence)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict]]:
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        start = self.start
        streams = [_TokenStream(source.documents, self.tokenizer, position, self.repeat, repr(source.name),
                                log_epochs=worker_id == 0) for source, position in zip(self.sources, start.sources)]
        sequence, counts = start.sequence, np.array(start.stage_counts or (0,) * len(self.sources), dtype=np.int64)
        stage = self._stage_at(max(sequence - 1, 0))  # the stage the saved counts belong to
        rows = self.local_batch_size * self.dp_world_size
        mine = np.arange(self.local_batch_size) * self.dp_world_size + self.dp_rank
        round_index = 0
        while True:
            windows = np.empty((rows, self.seq_len + 1), dtype=np.int64)
            tokens = np.zeros(len(self.sources), dtype=np.int64)
            for row in range(rows):
                now = self._stage_at(sequence)
                if now != stage:
                    stage, counts = now, np.zeros(len(self.sources), dtype=np.int64)
                s = int(pick_sources(self.stages[stage].weights, counts, 1)[0])
                window = streams[s].window(self.seq_len)
                if window is None:
                    raise DataError(f"data source {self.sources[s].name!r} ran out of data at global sequence "
                                    f"{sequence}; set data.on_exhausted = 'repeat' to start it over, or give it "
                                    "more data or a smaller weight")
                windows[row] = window
                tokens[s] += self.seq_len
                sequence += 1
            if round_index % num_workers == worker_id:
                position = MixturePosition(sequence, tuple(int(c) for c in counts),
                                           tuple(stream.position() for stream in streams), self.names)
                yield text_batch(windows[mine], self.tokenizer.bos_id), {
                    "position": position.state_dict(),
                    "counts": {f"tokens/{source.name}": int(t) for source, t in zip(self.sources, tokens)},
                    "gauges": {f"epoch/{source.name}": stream.position().epoch
                               for source, stream in zip(self.sources, streams)},
                }
            round_index += 1


def config_problems(data, training) -> list[tuple[str, str]]:
    """Problems with the [data] section (a mixture) as (field, reason) pairs."""
    if not data.sources:
        return [("stages", "needs [[data.sources]]")] if data.stages else []
    from torchtitan.data.shards import is_shard_folder
    from torchtitan.remote import is_url

    if training.dataset_path is not None or training.dataset_format != "text":
        return [("sources", "replace training.dataset: leave training.dataset_path unset and dataset_format 'text'")]
    for i, source in enumerate(data.sources):
        where = f"sources[{i}]"
        if not 0 < source.weight < float("inf"):
            return [(where, f"weight {source.weight} must be > 0 and finite (a stage may set 0 to leave the "
                            "source out)")]
        if source.kind == "tokens" and (source.path is None or not (is_url(source.path) or
                                                                    is_shard_folder(source.path))):
            return [(where, f"path {source.path!r} is not a shard folder (manifest.json from "
                            "scripts/tokenize_dataset.py), which kind 'tokens' reads")]
        if source.kind == "text" and source.path is not None and not is_url(source.path) and \
                is_shard_folder(source.path):
            # Read as text, its manifest.json would be taken for a JSON data file without a text column.
            return [(where, f"has kind = 'text', which reads path {source.path!r} as text files, but it is a shard "
                            'folder (manifest.json from scripts/tokenize_dataset.py): kind = "tokens" would read it')]
        from torchtitan.data.sources import source_problems

        format = "tokens" if source.kind == "tokens" else "text"
        for field_name, reason in source_problems(source.dataset, source.path, "train", format):
            return [(where, f"{field_name.replace('dataset_path', 'path')}: {reason}")]
    names = [source.name for source in data.sources if source.name]
    if len(set(names)) != len(names):
        return [("sources", f"names {names} repeat; each source needs its own (they name its metrics)")]
    previous = 0
    for i, stage in enumerate(data.stages):
        if stage.start_step <= previous:
            return [(f"stages[{i}]", f"start_step {stage.start_step} must be >= 1 and after the previous stage's")]
        previous = stage.start_step
        finite = all(0 <= w < float("inf") for w in stage.weights)
        if len(stage.weights) != len(data.sources) or not finite or sum(stage.weights) <= 0:
            return [(f"stages[{i}]", f"weights {stage.weights} must be {len(data.sources)} numbers (one per source) "
                                     ">= 0 with a positive sum")]
    return []
