"""Where checkpoints are kept: a local folder, or a URL reached through fsspec (``s3://``, ``gs://``, ``file://`` …).

What "complete" means differs, because object stores have no atomic rename (a "move" copies and deletes object
by object):

- Local folder: a checkpoint is written to ``step-N.partial/`` and renamed to ``step-N/`` once every rank is
  done. The rename is atomic, so ``step-N/`` is either complete or absent; a ``.partial`` folder is an unfinished
  save (or delete) of this program's and is removed on the next start.
- URL: a checkpoint is written to ``step-N/`` directly and the marker object ``step-N/.complete`` is written
  last, after every rank's files and DCP's ``.metadata``. A step without its marker is never loaded. A save
  begins by writing ``step-N/.in-progress`` (removed once ``.complete`` is there) and a delete writes it again
  before removing anything, so a step cut short carries it and is deleted on the next start.

Nothing else is ever written over or removed: a step folder that is neither complete nor marked as this
program's own unfinished save (written by another tool, by an earlier version that did not mark its saves, or
its marker deleted) makes the run refuse to start (``refuse_unowned``), since its saves would write over it.

Pickles are never unpickled freely, so a crafted checkpoint (e.g. in a shared bucket) cannot run code when loaded:
DCP's ``.metadata`` file is read with an unpickler that admits only the classes checkpoint metadata is made of,
and the entries DCP stores as pickled bytes (values that are not tensors, such as the optimizer's param groups:
learning rates, betas, flags) with torch.load's weights-only unpickler (``SafeLoadPlanner``).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan.log import logger, one_line
from torchtitan.remote import filesystem, is_url, join

STEP_DIR = re.compile(r"^step-(\d+)$")
# The folders a run writes into its checkpoint folder: full checkpoints and model-only exports.
OUR_FOLDER = re.compile(r"^(export-)?step-(\d+)$")
PARTIAL_SUFFIX = ".partial"
METADATA_FILE = ".metadata"
COMPLETE_MARKER = ".complete"
IN_PROGRESS_MARKER = ".in-progress"
T = TypeVar("T")


class CheckpointError(Exception):
    """A checkpoint cannot be read or written; the message names the path."""


def checkpoint_location(dump_folder: str, folder: str) -> str:
    """``checkpoint.folder`` under ``job.dump_folder``, unless it is an absolute path or a URL (then it wins)."""
    return folder if is_url(folder) else str(Path(dump_folder) / folder)


def open_storage(location: str) -> LocalStorage | RemoteStorage:
    return RemoteStorage(location) if is_url(location) else LocalStorage(location)


def complete_steps(location: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint under ``location`` (a folder or URL), ascending."""
    return open_storage(str(location)).steps()


def writer_for(location: str):
    """DCP's storage writer for a checkpoint folder or URL."""
    if is_url(location):
        # Object stores make a file durable when it is closed (uploaded); there is no file descriptor to fsync.
        return _fsspec_dcp().FsspecWriter(location, sync_files=False)
    return FileSystemWriter(location)


def reader_for(location: str):
    """DCP's storage reader for a checkpoint folder or URL, reading ``.metadata`` with the restricted unpickler."""
    return _safe_fsspec_reader()(location) if is_url(location) else _SafeFileSystemReader(location)


# What DCP's .metadata is made of: its metadata dataclasses, the per-file storage info, sizes, dtypes and
# layouts, and plain containers. Anything else in the pickle is refused before it is looked up.
_METADATA_MODULES = {"torch.distributed.checkpoint.metadata": dcp_metadata}
_ADMITTED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name, nothing else
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    *(("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset", "slice", "int", "float", "bool",
                                      "str", "bytes", "complex")),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(found := vars(torch).get(name), _TORCH_VALUES):
            return found  # a dtype, layout or memory format, pickled by name
        found = getattr(_METADATA_MODULES.get(module), name, None)
        if isinstance(found, type) and found.__module__ == module:
            return found
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata is never made of")


class _RestrictedMetadata:
    """``read_metadata`` as DCP's readers do it, with ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"refusing checkpoint metadata {path}: {one_line(e)}") from None
            except Exception as e:  # a truncated or foreign file
                raise CheckpointError(f"cannot read checkpoint metadata {path}: {one_line(e)}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"refusing checkpoint metadata {path}: it holds a {type(metadata).__name__}, "
                                  "not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeFileSystemReader(_RestrictedMetadata, FileSystemReader):
    pass


@functools.cache
def _safe_fsspec_reader() -> type:
    """DCP's fsspec reader with the restricted metadata unpickler (its module is imported only for URLs)."""
    return type("_SafeFsspecReader", (_RestrictedMetadata, _fsspec_dcp().FsspecReader), {})


_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
_WEIGHTS_ONLY_DETAIL = "WeightsUnpickler error:"


def _weights_only_reason(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, out of its message (a paragraph on how to load it anyway)."""
    text = str(error)
    if found := _UNSUPPORTED_GLOBAL.search(text):
        return f"it names {found.group(1)}"
    detail = text.split(_WEIGHTS_ONLY_DETAIL, 1)[1].strip().splitlines() if _WEIGHTS_ONLY_DETAIL in text else []
    return detail[0] if detail else one_line(error)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the entries stored as pickled bytes with torch.load's weights-only unpickler
    (numbers, strings, bools, None, tuples, lists, dicts, tensors): DCP's own planner unpickles them freely, so an
    entry such as ``optimizer.param_groups.NAME.lr`` could hold an object that runs code when loaded."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"refusing the entry {name}: {_weights_only_reason(e)}; an entry is loaded only "
                                  "when it holds plain values (numbers, strings, tuples, tensors)") from None
        except Exception as e:  # truncated or not a pickle
            raise CheckpointError(f"cannot read the entry {name}: {one_line(e)}") from None
        # Placed where DCP's own load_bytes places it.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[name], loaded)
        else:
            self.state_dict[name] = loaded


def _file_sizes(location: str) -> dict[str, int]:
    """Name -> size of the files directly in a checkpoint folder or URL (one listing call for object stores)."""
    if not is_url(location):
        folder = Path(location)
        return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}
    fs, path = filesystem(location)
    try:
        found = fs.find(path, maxdepth=1, detail=True)
    except FileNotFoundError:
        return {}
    return {name.rsplit("/", 1)[-1]: int(info["size"]) for name, info in found.items() if info.get("type") == "file"}


def verify_checkpoint(location: str) -> Metadata:
    """Check that a checkpoint's metadata reads and every file it names is there, long enough; return it."""
    try:
        sizes = _file_sizes(location)
    except Exception as e:  # an unreachable URL
        raise CheckpointError(f"cannot list checkpoint {location}: {one_line(e)}") from None
    if METADATA_FILE not in sizes:
        raise CheckpointError(f"{location} is not a complete checkpoint: {METADATA_FILE} is missing")
    try:
        metadata = reader_for(location).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint metadata {join(location, METADATA_FILE)}: "
                              f"{one_line(e)}") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for file, size in sorted(needed.items()):
        if file not in sizes:
            raise CheckpointError(f"checkpoint file {join(location, file)} is missing")
        if sizes[file] < size:
            raise CheckpointError(f"checkpoint file {join(location, file)} is truncated: {sizes[file]} bytes, "
                                  f"the metadata expects at least {size}")
    return metadata


class _Storage:
    location: str

    def where(self, name: str) -> str:
        """Where the complete checkpoint ``name`` is (a path or URL), for loading and for messages."""
        return join(self.location, name)

    def saved_after(self, step: int) -> list[str]:
        """The complete step and export folders of steps after ``step``, oldest first (what a run resumed at
        ``step`` would overwrite or prune)."""
        found = [(int(match.group(2)), bool(match.group(1)), name) for name in self._complete_folders()
                 if (match := OUR_FOLDER.match(name))]
        return [name for n, _, name in sorted(found) if n > step]

    def refuse_unowned(self) -> None:
        """Refuse to go on when the folder holds step or export folders that are neither complete checkpoints
        nor this program's own unfinished saves: saving the same step would write over them."""
        unowned = self.unowned()
        if unowned:
            raise CheckpointError(
                f"checkpoint folder {self.location} holds {', '.join(unowned)}: not a complete checkpoint, nor a save "
                "this program left unfinished (written by another tool, or by a torchtitan version before this one, "
                "which did not mark the saves it left unfinished, or its marker was deleted); the run would write "
                "over it, so it is left alone: move it away (or delete it, if it is a save that was cut short), or "
                "set checkpoint.folder to another folder")


class LocalStorage(_Storage):
    """A local folder: complete checkpoints are renamed into place (atomic, fsynced). ``NAME.partial`` folders are
    this program's own unfinished saves and deletes (nothing else names them so)."""

    def __init__(self, location: str):
        self.location = location
        self.folder = Path(location)

    def check_reachable(self) -> None:
        """A path that is (or lies under) a file fails here, before training, instead of at the first save; other
        bad paths fail at the first save with the OS's message."""
        path = self.folder
        while not path.exists() and path != path.parent:
            path = path.parent
        if path.exists() and not path.is_dir():
            where = "is a file" if path == self.folder else f"lies under {path}, which is a file"
            raise CheckpointError(f"checkpoint.folder: {self.location} {where}, not a folder; set checkpoint.folder "
                                  "(or job.dump_folder) to a folder")

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        steps = []
        for child in self.folder.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / METADATA_FILE).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def _complete_folders(self) -> list[str]:
        # Renamed into place only when complete (an unowned one is refused before anything else).
        return [child.name for child in self.folder.iterdir() if OUR_FOLDER.match(child.name)] \
            if self.folder.is_dir() else []

    def unowned(self) -> list[str]:
        """Step or export folders (by name) that hold no checkpoint: a DCP .metadata or a Hugging Face
        config.json, which every folder renamed into place has."""
        if not self.folder.is_dir():
            return []
        return sorted(f"{child.name} (no {METADATA_FILE}" + (" or config.json)" if child.name.startswith("export")
                                                             else ")")
                      for child in self.folder.iterdir()
                      if OUR_FOLDER.match(child.name) and not ((child / METADATA_FILE).is_file() or
                                                               (child / "config.json").is_file()))

    def target(self, name: str) -> str:
        """Where every rank writes ``name`` (once rank 0 has begun it)."""
        return str(self.folder / f"{name}{PARTIAL_SUFFIX}")

    def begin(self, name: str) -> None:
        partial = Path(self.target(name))
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def commit(self, name: str) -> None:
        final = self.folder / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self.folder / f"{name}{PARTIAL_SUFFIX}", final)
        _fsync_dir(self.folder)

    def delete(self, name: str) -> None:
        partial = self.folder / f"{name}{PARTIAL_SUFFIX}"
        if (self.folder / name).exists():
            # Renamed first: a delete cut short leaves a .partial folder, removed on the next start, never a
            # step folder without its .metadata.
            shutil.rmtree(partial, ignore_errors=True)
            os.replace(self.folder / name, partial)
        shutil.rmtree(partial, ignore_errors=True)

    def remove_incomplete(self) -> None:
        if self.folder.is_dir():
            for child in self.folder.iterdir():
                base = child.name.removesuffix(PARTIAL_SUFFIX)
                if base != child.name and OUR_FOLDER.match(base) and child.is_dir():
                    logger.info(f"removing the incomplete checkpoint {child} (a save that was cut short)")
                    shutil.rmtree(child, ignore_errors=True)

    def write_folder(self, name: str, write: Callable[[Path], T]) -> T:
        partial = self.folder / f"{name}{PARTIAL_SUFFIX}"
        shutil.rmtree(partial, ignore_errors=True)
        result = write(partial)
        self.commit(name)
        return result


class RemoteStorage(_Storage):
    """A URL: complete checkpoints carry a marker object, written last; unfinished saves and deletes of this
    program carry another (see the module doc)."""

    def __init__(self, location: str):
        self.location = location.rstrip("/")
        try:
            self.fs, self.root = filesystem(self.location)
        except (ValueError, ImportError) as e:
            raise CheckpointError(f"checkpoint location {self.location}: {one_line(e)}") from None
        _fsspec_dcp()

    def check_reachable(self) -> None:
        """List the folder, or for a new one write and delete a probe object in it, so that a wrong URL, a missing
        bucket or missing credentials fail before training. (No makedirs: on s3fs it would create a bucket that
        a typo named.)"""
        try:
            self.fs.ls(self.root, detail=False)
            is_file = self.fs.isfile(self.root)
        except FileNotFoundError:
            is_file = None  # a new folder (object stores have no empty folders)
        except Exception as e:
            raise CheckpointError(f"checkpoint location {self.location} is unreachable: {one_line(e)}") from None
        if is_file:
            raise CheckpointError(f"checkpoint.folder: {self.location} is a file, not a folder; set checkpoint.folder "
                                  "to a folder")
        if is_file is not None:
            return
        probe = self._path(".torchtitan-probe")
        try:
            if "file" in self.fs.protocol:  # a local filesystem needs the folder itself
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"")
            self.fs.rm(probe)
        except Exception as e:
            raise CheckpointError(f"checkpoint location {self.location} is unreachable or not writable: "
                                  f"{one_line(e)}") from None

    def _path(self, *names: str) -> str:
        return join(self.root, *names)

    def _has(self, name: str, marker: str) -> bool:
        return self.fs.exists(self._path(name, marker))

    def steps(self) -> list[int]:
        return sorted(int(STEP_DIR.match(name).group(1)) for name in self._children()
                      if STEP_DIR.match(name) and self._has(name, COMPLETE_MARKER))

    def _children(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def _complete_folders(self) -> list[str]:
        return [name for name in self._children() if OUR_FOLDER.match(name) and self._has(name, COMPLETE_MARKER)]

    def _unfinished(self) -> list[str]:
        """Step and export folders without their completion marker."""
        return [name for name in self._children() if OUR_FOLDER.match(name) and not self._has(name, COMPLETE_MARKER)]

    def unowned(self) -> list[str]:
        unowned = []
        for name in self._unfinished():
            if self._has(name, IN_PROGRESS_MARKER):
                continue
            hint = f"; it holds {METADATA_FILE}: to resume from it, add its {COMPLETE_MARKER} marker" \
                if self._has(name, METADATA_FILE) else ""
            unowned.append(f"{name} (no {COMPLETE_MARKER} marker{hint})")
        return sorted(unowned)

    def target(self, name: str) -> str:
        """Where every rank writes ``name`` (once rank 0 has begun it): the final place, marked complete later."""
        return self.where(name)

    def begin(self, name: str) -> None:
        self.delete(name)  # whatever an interrupted save of this step left
        self.fs.makedirs(self._path(name), exist_ok=True)
        self.fs.pipe_file(self._path(name, IN_PROGRESS_MARKER), b"")

    def commit(self, name: str) -> None:
        self.fs.pipe_file(self._path(name, COMPLETE_MARKER), b"complete\n")
        if self._has(name, IN_PROGRESS_MARKER):
            self.fs.rm(self._path(name, IN_PROGRESS_MARKER))

    def delete(self, name: str) -> None:
        """Mark the folder as an unfinished operation of ours, drop its completion marker, then its files, the
        in-progress marker last: a delete cut short is finished on the next start."""
        folder = self._path(name)
        if not self.fs.exists(folder):
            return
        self.fs.pipe_file(self._path(name, IN_PROGRESS_MARKER), b"")
        if self._has(name, COMPLETE_MARKER):
            self.fs.rm(self._path(name, COMPLETE_MARKER))
        rest = [path for path in self.fs.find(folder) if path.rstrip("/").rsplit("/", 1)[-1] != IN_PROGRESS_MARKER]
        if rest:
            self.fs.rm(rest)
        self.fs.rm(folder, recursive=True)

    def remove_incomplete(self) -> None:
        for name in self._unfinished():
            if self._has(name, IN_PROGRESS_MARKER):
                logger.info(f"removing the incomplete checkpoint {self.where(name)} (a save that was cut short)")
                self.delete(name)

    def write_folder(self, name: str, write: Callable[[Path], T]) -> T:
        """Write a folder locally (e.g. a Hugging Face export), upload it, then mark it complete."""
        with tempfile.TemporaryDirectory(prefix="torchtitan-upload-") as tmp:
            local = Path(tmp) / name
            result = write(local)
            self.begin(name)
            for file in sorted(p for p in local.rglob("*") if p.is_file()):
                self.fs.put_file(str(file), self._path(name, *file.relative_to(local).parts))
        self.commit(name)
        return result


def _fsspec_dcp():
    """PyTorch's fsspec reader/writer for distributed checkpoints, which lives in a private module."""
    try:
        from torch.distributed.checkpoint import _fsspec_filesystem
    except ImportError as e:
        raise CheckpointError(f"checkpoints at URLs need torch.distributed.checkpoint._fsspec_filesystem, which "
                              f"this PyTorch ({torch.__version__}) lacks: {one_line(e)}; use a local "
                              "checkpoint.folder") from None
    return _fsspec_filesystem


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
