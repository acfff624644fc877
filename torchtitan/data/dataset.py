"""Document sources (a name registry and local files) and the packed token-window dataset."""

from __future__ import annotations

import copy
import itertools
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.data.pydocs import load_pydocs_documents
from torchtitan.data.tokenizer import Tokenizer

DocumentLoader = Callable[[str], Iterable[str]]

_DATASETS: dict[str, DocumentLoader] = {}


def register_dataset(name: str, loader_fn: DocumentLoader) -> None:
    """Register (or replace) a dataset: loader_fn(split) returns that split's documents, re-iterable."""
    _DATASETS[name] = loader_fn


def registered_datasets() -> list[str]:
    """Return the names of the registered datasets, sorted."""
    return sorted(_DATASETS)


register_dataset("pydocs", load_pydocs_documents)


class LocalTextFile:
    """Documents of a local file, re-read on every iteration.

    A ``.jsonl`` file holds one JSON object with a "text" field per line; in a
    ``.txt`` file every non-empty line is a document.
    """

    SUFFIXES = (".jsonl", ".txt")

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        if self.path.suffix not in self.SUFFIXES:
            raise ValueError(f"unsupported dataset_path {str(self.path)!r}: expected one of {list(self.SUFFIXES)}")
        if not self.path.is_file():
            raise FileNotFoundError(f"dataset_path {str(self.path)!r} does not exist")

    def __iter__(self) -> Iterator[str]:
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                yield json.loads(line)["text"] if self.path.suffix == ".jsonl" else line.rstrip("\n")


def load_documents(dataset: str, dataset_path: str | None, split: str) -> Iterable[str]:
    """Return the documents of a split: the local file dataset_path if given, else the registered dataset."""
    if dataset_path is not None:
        # A local file stands on its own: it has no splits and the dataset name is only a label.
        return LocalTextFile(dataset_path)
    if dataset not in _DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; registered datasets: {registered_datasets()}")
    return _DATASETS[dataset](split)


class PackedTokenDataset(IterableDataset):
    """Fixed-length training windows cut from one stream of tokenized documents.

    Each document becomes BOS + tokens + EOS; the documents are concatenated in
    order and cut into windows of seq_len + 1 tokens that may span documents. A
    window starts at the last token of the previous one, so every adjacent pair
    of tokens in the stream is trained on exactly once. Each window yields
    ``(input_ids, labels) = (w[:-1], w[1:])``, both LongTensors of shape [seq_len].

    The window stream is global and identical on every data-parallel rank:
    window i belongs to rank ``i % dp_world_size``. Every rank therefore
    tokenizes the whole corpus, and the union of the ranks' batches at a step is
    exactly the single-process batch. A rank yields its window only once the
    whole round of dp_world_size windows exists, so with ``infinite=False`` all
    ranks yield the same number of windows (a trailing partial round is dropped).

    ``infinite=True`` restarts from the first document after the last one (the
    stream continues across the epoch boundary); otherwise iteration stops and
    the next iteration starts over from the beginning.

    ``state_dict``/``load_state_dict`` (torchdata's Stateful protocol) capture
    the stream position after the last yielded window, so a restored dataset
    yields exactly the windows the original would have yielded next.

    Only ``num_workers <= 1`` is supported: since each worker would have to
    tokenize the whole stream to know the global window order, more workers
    would add no throughput.
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
    ):
        if iter(documents) is documents:
            raise TypeError("documents must be re-iterable (e.g. a list), not a one-shot iterator")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(
                f"dp_rank must be in [0, {dp_world_size}) for dp_world_size={dp_world_size}, got {dp_rank}"
            )
        self._documents = documents
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._infinite = infinite
        self._state = self._initial_state()

    @staticmethod
    def _initial_state() -> dict:
        # The stream resumes at token doc_offset of document doc_index (in epoch
        # `epoch`), after the `carry` tokens already taken from earlier documents.
        return {"epoch": 0, "doc_index": 0, "doc_offset": 0, "carry": [], "windows_seen": 0}

    def state_dict(self) -> dict:
        """Return the stream position after the last yielded window."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from a position returned by state_dict."""
        missing = self._initial_state().keys() - state_dict.keys()
        if missing:
            raise ValueError(f"dataset state is missing keys {sorted(missing)}")
        if state_dict["windows_seen"] % self._dp_world_size != 0:
            raise ValueError(
                f"dataset state with windows_seen={state_dict['windows_seen']} was saved with a different "
                f"data-parallel degree than dp_world_size={self._dp_world_size}"
            )
        self._state = copy.deepcopy(state_dict)

    def _global_windows(self) -> Iterator[tuple[list[int], dict]]:
        """Yield every window of the global stream from the current state, with the state after it."""
        state = copy.deepcopy(self._state)
        epoch, doc_index, offset = state["epoch"], state["doc_index"], state["doc_offset"]
        buf, windows_seen = state["carry"], state["windows_seen"]
        window_len = self._seq_len + 1
        while True:
            for doc in itertools.islice(self._documents, doc_index, None):
                tokens = self._tokenizer.encode(doc, bos=True, eos=True)
                while len(buf) + len(tokens) - offset >= window_len:
                    take = window_len - len(buf)
                    window = buf + tokens[offset : offset + take]
                    offset += take
                    buf = window[-1:]
                    windows_seen += 1
                    after = {
                        "epoch": epoch,
                        "doc_index": doc_index,
                        "doc_offset": offset,
                        "carry": list(buf),
                        "windows_seen": windows_seen,
                    }
                    yield window, after
                buf = buf + tokens[offset:]
                offset = 0
                doc_index += 1
            if not self._infinite:
                return
            if doc_index == 0:
                raise ValueError("the dataset has no documents; cannot cycle through it")
            epoch += 1
            doc_index = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        if worker is not None and worker.num_workers > 1:
            raise ValueError(f"PackedTokenDataset supports num_workers <= 1, got num_workers={worker.num_workers}")
        mine = None
        for window, state in self._global_windows():
            position_in_round = (state["windows_seen"] - 1) % self._dp_world_size
            if position_in_round == self._dp_rank:
                mine = window
            if position_in_round == self._dp_world_size - 1:
                self._state = state
                tokens = torch.tensor(mine, dtype=torch.long)
                yield tokens[:-1], tokens[1:]
        # Only reached when finite: the next pass starts again from the first document.
        self._state = self._initial_state()
