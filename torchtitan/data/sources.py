"""Where documents come from: registered datasets (pydocs, HF hub datasets) and files, local or at a URL.

A document source is a re-iterable in a fixed order of strings (text datasets) or of conversations, each
a list of {"role", "content"} messages (chat datasets, see data/chat.py). Hub datasets and local files
(``training.dataset_path``) are read by the same code, ``datasets.load_dataset(..., streaming=True)``,
so the local-file tests exercise the path that streams from the hub on a connected machine. A
``dataset_path`` may be a URL (``s3://bucket/corpus/``, ``hf://datasets/...``, ``file://``): its files are
listed and streamed through fsspec by the same reader.

Bad data raises `DataError` with one line naming the file (or hub dataset) and the row, counted from 0.
"""

from __future__ import annotations

import bisect
import functools
import gzip
import json
import logging
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from torchtitan.data.arithmetic import load_arithmetic_chat
from torchtitan.data.chat import load_pydocs_chat
from torchtitan.data.errors import DataError
from torchtitan.data.pydocs import load_pydocs_documents
from torchtitan.data.shapes import ShapesChat
from torchtitan.log import one_line
from torchtitan.registry import Registry
from torchtitan.remote import filesystem, is_url, url_problem

DocumentLoader = Callable[[str], Iterable]

DATASETS: Registry[DocumentLoader] = Registry("dataset", replace=True)
# The format of each registered dataset's rows: "text" (strings) or "chat" (conversations).
DATASET_FORMATS: dict[str, str] = {}
_ROW_TYPES = {"text": (str, "text"), "chat": (list, "a list of messages")}

# File suffix -> the `datasets` builder that reads it; json, jsonl and txt may also be gzipped (.gz).
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
_COMPRESSIBLE = (".jsonl", ".json", ".txt")

# Rows fetched per read; large enough to amortise the per-batch overhead of `datasets`.
_ROWS_PER_READ = 1024


def register_dataset(name: str, loader_fn: DocumentLoader, format: str = "text") -> None:
    """Register (or replace) a dataset: loader_fn(split) returns that split's documents, re-iterable;
    ``format`` "chat" when they are conversations rather than text."""
    if format not in _ROW_TYPES:
        raise ValueError(f"dataset format {format!r} is not one of {', '.join(_ROW_TYPES)}")
    DATASETS.register(name, loader_fn)
    DATASET_FORMATS[name] = format


def registered_datasets() -> list[str]:
    """Return the names of the registered datasets, sorted."""
    return DATASETS.names()


def _quiet_datasets_errors() -> None:
    # `datasets` logs its own copy of a read error before raising it; ours names the file and row.
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)


def _type_problem(value, column: str, format: str) -> str | None:
    """Why a row's (non-null) value cannot be a document of ``format``, or None."""
    row_type, row_kind = _ROW_TYPES[format]
    if isinstance(value, row_type):
        return None
    return f"column {column!r} holds {type(value).__name__} {value!r:.40}, not {row_kind}"


BadRow = tuple[int, "str | None"]  # a row's index and what is wrong with it (None: it does not parse)


def _stream_texts(
    open_dataset: Callable[[], object], where: str, text_column: str, locate_bad_row: Callable[[], BadRow | None],
    format: str = "text", whole_rows: bool = False, column_field: str | None = None,
) -> Iterator:
    """Yield one column of a streamed `datasets` dataset row by row (text, or conversations for the chat
    format), or with ``whole_rows`` each row as a dict of all its columns (the column checked as before), turning
    bad data into DataError; ``column_field`` is the config field that names the column, for messages.

    A reader may fail on a whole block (e.g. pyarrow refusing a column whose type changes at some row), before
    yielding any of its rows: ``locate_bad_row`` then finds the row in the file itself, so that the message
    names the right row whatever version of the reader parsed it."""
    _quiet_datasets_errors()
    column_field = column_field or ("dataset_text_column" if format == "text" else "training.chat.messages_column")
    row = 0
    try:
        for rows in open_dataset().iter(batch_size=_ROWS_PER_READ):
            if text_column not in rows:
                raise DataError(
                    f"{where}: row {row} has no column {text_column!r} (columns: {', '.join(sorted(rows))}); "
                    f"set {column_field}"
                )
            for i, text in enumerate(rows[text_column]):
                if text is None:  # a row without the column, where other rows have it
                    raise DataError(f"{where}: row {row} has no value in column {text_column!r} (missing or null)")
                if problem := _type_problem(text, text_column, format):
                    raise DataError(f"{where}: row {row}: {problem}")
                yield {name: values[i] for name, values in rows.items()} if whole_rows else text
                row += 1
    except DataError:
        raise
    except Exception as e:  # whatever the reader raises, the user needs the file and row
        located = locate_bad_row()
        if located is not None and located[0] < row:  # a row the reader took: not the one it failed on
            located = None
        if located is not None and located[1] is not None:
            raise DataError(f"{where}: row {located[0]}: {located[1]}") from None
        if located is None and row == 0 and isinstance(e, StopIteration):  # `datasets` on a JSON file of no bytes
            raise DataError(f"{where}: the file is empty (no rows)") from None
        bad_row = row if located is None else located[0]
        # The reader's own "in row N" counts within the block it was parsing, not the file: only ours is said.
        reason = re.sub(r",? in row \d+", "", one_line(e))
        raise DataError(f"{where}: row {bad_row}: cannot read: {reason}") from None


def _text_object(line: bytes) -> dict | None:
    """A JSON-lines row as the JSON object of UTF-8 text that readers require, or None if it is not one."""
    try:
        row = json.loads(line.decode("utf-8"))
        # Python's json accepts an escaped lone surrogate (e.g. "\\ud800"), which is not text; readers refuse it.
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):  # bad UTF-8 or JSON (ValueError), or a lone surrogate
        return None
    return row if isinstance(row, dict) else None


def _first_bad_json_line(path: str, column: str, format: str) -> BadRow | None:
    """The first row of a JSON-lines file that is not a JSON object of text, or whose ``column`` holds a value of
    the wrong type (readers report blocks, not lines); rows count non-blank lines from 0."""
    if is_url(path):
        import fsspec

        opener = lambda p, mode: fsspec.open(p, mode, compression="infer")  # noqa: E731
    else:
        opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            index = 0
            for line in f:
                if not line.strip():
                    continue
                row = _text_object(line)
                if row is None:
                    return index, None
                if row.get(column) is not None and (problem := _type_problem(row[column], column, format)):
                    return index, problem
                index += 1
    except Exception:  # unreadable (a truncated gzip, a lost connection): the reader's own error is reported
        pass
    return None


def _data_suffix(path: pathlib.PurePath) -> str | None:
    suffixes = path.suffixes[-2:]
    if suffixes and suffixes[-1] == ".gz":
        return suffixes[0] if len(suffixes) == 2 and suffixes[0] in _COMPRESSIBLE else None
    return path.suffix if path.suffix in FILE_BUILDERS else None


_VALID_FILES = ", ".join([*FILE_BUILDERS, *(s + ".gz" for s in _COMPRESSIBLE)])


def _url_data_files(url: str) -> list[str]:
    """data_files for a URL: the object itself, or the known-type files under it in sorted order."""
    try:
        fs, root = filesystem(url)
        single = fs.info(root)["type"] == "file"
        found = [root] if single else fs.find(root)
    except FileNotFoundError:
        raise DataError(f"dataset_path {url!r} does not exist") from None
    except Exception as e:  # unreachable, no credentials, unknown protocol
        raise DataError(f"dataset_path {url!r}: cannot reach it: {one_line(e)}") from None
    if single:
        if _data_suffix(pathlib.PurePosixPath(root)) is None:
            raise DataError(f"dataset_path {url!r} has an unsupported file type; valid: {_VALID_FILES}")
        return [url]
    relative = [pathlib.PurePosixPath(p).relative_to(root.rstrip("/")) for p in found]
    files = sorted(r.parts for r in relative if _data_suffix(r) is not None
                   and not any(part.startswith(".") for part in r.parts))
    if not files:
        raise DataError(f"dataset_path {url!r} holds no data files; valid types: {_VALID_FILES}")
    base = url.rstrip("/")
    return [f"{base}/{'/'.join(parts)}" for parts in files]


def data_files(path: str | pathlib.Path) -> list[pathlib.Path] | list[str]:
    """The data files of a dataset_path: the file itself, or a folder's files of known types in sorted order
    (URLs for a URL)."""
    if is_url(str(path)):
        return _url_data_files(str(path))
    root = pathlib.Path(path)
    valid = _VALID_FILES
    if root.is_file():
        if _data_suffix(root) is None:
            raise DataError(f"dataset_path {str(root)!r} has an unsupported file type; valid: {valid}")
        return [root]
    if not root.is_dir():
        raise DataError(f"dataset_path {str(root)!r} does not exist")
    # Sorting relative paths (not walk order) keeps the document order independent of the filesystem.
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and _data_suffix(p) is not None
         and not any(part.startswith(".") for part in p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).parts,
    )
    if not files:
        raise DataError(f"dataset_path {str(root)!r} holds no data files; valid types: {valid}")
    return files


class LocalFiles:
    """Documents of local files (one row each), read file after file in sorted order on every iteration; with
    ``whole_rows``, each row as a dict of all its columns, ``text_column`` checked to hold a document."""

    def __init__(self, path: str | pathlib.Path, text_column: str = "text", format: str = "text",
                 whole_rows: bool = False, column_field: str | None = None):
        self.files = data_files(path)
        self.text_column = text_column
        self.format = format
        self.whole_rows, self.column_field = whole_rows, column_field
        # The index of each file's first row, for the files read so far (the same on every pass).
        self._first_rows: list[int] = []

    def locate(self, index: int) -> str:
        """Where the document at ``index`` (counted over all files, as iteration yields them) comes from: its
        file and its row there, for messages about it. Only for documents already yielded."""
        file = bisect.bisect_right(self._first_rows, index) - 1
        return f"{self.files[file]}: row {index - self._first_rows[file]}"

    def file_of(self, index: int) -> pathlib.Path | None:
        """The local file the document at ``index`` comes from (None for a URL): image paths are relative to
        its folder. Only for documents already yielded."""
        file = self.files[bisect.bisect_right(self._first_rows, index) - 1]
        return file if isinstance(file, pathlib.Path) else None

    def __iter__(self) -> Iterator[str]:
        import datasets

        count = 0
        for number, path in enumerate(self.files):
            if number == len(self._first_rows):
                self._first_rows.append(count)
            suffix = _data_suffix(pathlib.PurePosixPath(str(path)))

            def open_file(path=path, builder=FILE_BUILDERS[suffix]):
                return datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)

            def locate(path=path, suffix=suffix):
                return _first_bad_json_line(str(path), self.text_column, self.format) if suffix == ".jsonl" else None

            for document in _stream_texts(open_file, str(path), self.text_column, locate, self.format,
                                          self.whole_rows, self.column_field):
                count += 1
                yield document


@dataclass(frozen=True)
class HubDocuments:
    """Documents of one split of a Hugging Face hub dataset, streamed (nothing is downloaded up front)."""

    path: str
    config: str | None
    split: str
    text_column: str = "text"
    format: str = "text"

    def __iter__(self) -> Iterator[str]:
        import datasets

        where = f"hub dataset {self.path} ({self.config}, split {self.split})"
        try:
            dataset = datasets.load_dataset(self.path, self.config, split=self.split, streaming=True)
        except Exception as e:  # offline, unknown repo, gated without a token, ...
            raise DataError(
                f"{where}: cannot open: {one_line(e)}; check the network and HF_TOKEN, "
                f"or set training.dataset_path to a local copy"
            ) from None
        yield from _stream_texts(lambda: dataset, where, self.text_column, lambda: None, self.format)


@dataclass(frozen=True)
class HubDataset:
    """A registered hub dataset: repository, config and our split names mapped to the hub's."""

    path: str
    config: str | None
    splits: dict[str, str]
    column: str = "text"
    format: str = "text"

    def __call__(self, split: str) -> HubDocuments:
        if split not in self.splits:
            raise DataError(f"hub dataset {self.path} has no {split!r} split here; valid: {', '.join(self.splits)}")
        return HubDocuments(self.path, self.config, self.splits[split], self.column, self.format)


HUB_DATASETS = {
    "c4": HubDataset("allenai/c4", "en", {"train": "train", "validation": "validation"}),
    # C4's validation split under its own name, for validation.dataset (or training on it).
    "c4_validation": HubDataset("allenai/c4", "en", {"train": "validation", "validation": "validation"}),
    "fineweb-edu": HubDataset("HuggingFaceFW/fineweb-edu", "sample-10BT", {"train": "train"}),
    "wikitext-103": HubDataset(
        "Salesforce/wikitext", "wikitext-103-raw-v1", {"train": "train", "validation": "validation", "test": "test"}
    ),
}

register_dataset("pydocs", load_pydocs_documents)
register_dataset("pydocs_chat", load_pydocs_chat, "chat")
register_dataset("arithmetic_chat", load_arithmetic_chat, "chat")
register_dataset("shapes", ShapesChat, "chat")
register_dataset("shapes_blank", functools.partial(ShapesChat, blank=True), "chat")
for _name, _dataset in HUB_DATASETS.items():
    register_dataset(_name, _dataset, _dataset.format)


def source_problems(dataset: str, dataset_path: str | None, split: str,
                    format: str = "text") -> list[tuple[str, str]]:
    """Problems with a section's data source (its ``dataset`` / ``dataset_path`` fields) as (field, reason)."""
    if format == "tokens":
        if dataset_path is None:
            return [("dataset_path", "is required by dataset_format 'tokens': a folder made by "
                                     "scripts/tokenize_dataset.py")]
        if is_url(dataset_path):
            problem = url_problem(dataset_path)
            return [] if problem is None else [("dataset_path", problem)]
        if not (pathlib.Path(dataset_path) / "manifest.json").is_file():
            return [("dataset_path", "holds no manifest.json: not a folder made by scripts/tokenize_dataset.py "
                                     "(dataset_format 'tokens')")]
        return []
    if dataset_path is not None:
        if is_url(dataset_path):  # reached when the data is opened, before training
            problem = url_problem(dataset_path)
            return [] if problem is None else [("dataset_path", problem)]
        if (pathlib.Path(dataset_path) / "manifest.json").is_file():  # else read as JSON rows without the column
            return [("dataset_path", f"is a folder of token shards (manifest.json from scripts/tokenize_dataset.py), "
                                     f"not {format} files; dataset_format = 'tokens' would read it")]
        return [] if pathlib.Path(dataset_path).exists() else [("dataset_path", "does not exist")]
    if dataset not in DATASETS:
        return [("dataset", f"is not a registered dataset; valid: {', '.join(registered_datasets())}")]
    if DATASET_FORMATS.get(dataset, "text") != format:
        same = [name for name in registered_datasets() if DATASET_FORMATS.get(name, "text") == format]
        return [("dataset", f"holds {DATASET_FORMATS.get(dataset, 'text')} data, not {format} (dataset_format); "
                            f"valid {format} datasets: {', '.join(same)}")]
    hub = HUB_DATASETS.get(dataset)
    if hub is not None and split not in hub.splits:
        with_split = ["pydocs"] + [name for name, d in HUB_DATASETS.items() if split in d.splits]
        return [("dataset", f"has no {split} split; valid: {', '.join(with_split)}")]
    return []


def load_documents(dataset: str, dataset_path: str | None, split: str, text_column: str = "text",
                   format: str = "text", whole_rows: bool = False) -> Iterable:
    """The documents of a split: the local dataset_path if given (it has no splits), else the registered
    dataset; ``text_column`` is the column read from files (the messages column for chat data), and with
    ``whole_rows`` a file's rows come whole, as dicts (image conversations: the messages and their images)."""
    if dataset_path is not None:
        return LocalFiles(dataset_path, text_column, format, whole_rows=whole_rows)
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; registered datasets: {', '.join(registered_datasets())}")
    if DATASET_FORMATS.get(dataset, "text") != format:
        raise DataError(f"dataset {dataset!r} holds {DATASET_FORMATS[dataset]} data, not {format}; set the "
                        f"section's dataset_format = {DATASET_FORMATS[dataset]!r}")
    return DATASETS.get(dataset)(split)
