"""Where checkpoints are kept: a local folder, or a URL reached through fsspec (``s3://``, ``gs://``, ``file://`` …).

What "complete" means differs, because object stores have no atomic rename (a "move" copies and deletes object
by object):

- Local folder: a checkpoint is written to ``step-N.partial/`` and renamed to ``step-N/`` once every rank is
  done. The rename is atomic, so ``step-N/`` is either complete or absent.
- URL: a checkpoint is written to ``step-N/`` directly and the marker object ``step-N/.complete`` is written
  last, after every rank's files and DCP's ``.metadata``. A step without its marker is never loaded and is
  deleted on the next start; deleting a step removes its marker first, so a half-deleted step is incomplete too.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from torchtitan.log import logger, one_line
from torchtitan.remote import filesystem, is_url, join

STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"
METADATA_FILE = ".metadata"
COMPLETE_MARKER = ".complete"
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
    """DCP's storage reader for a checkpoint folder or URL."""
    return _fsspec_dcp().FsspecReader(location) if is_url(location) else FileSystemReader(location)


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


class LocalStorage(_Storage):
    """A local folder: complete checkpoints are renamed into place (atomic, fsynced)."""

    def __init__(self, location: str):
        self.location = location
        self.folder = Path(location)

    def check_reachable(self) -> None:
        pass  # created on the first save; a bad local path fails there with the OS's message

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        steps = []
        for child in self.folder.iterdir():
            match = STEP_DIR.match(child.name)
            if match and (child / METADATA_FILE).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

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
        shutil.rmtree(self.folder / name, ignore_errors=True)

    def remove_incomplete(self) -> None:
        if self.folder.is_dir():
            for child in self.folder.iterdir():
                if child.name.endswith(PARTIAL_SUFFIX):
                    logger.info(f"removing the incomplete checkpoint {child} (a save that was cut short)")
                    shutil.rmtree(child, ignore_errors=True)

    def write_folder(self, name: str, write: Callable[[Path], T]) -> T:
        partial = self.folder / f"{name}{PARTIAL_SUFFIX}"
        shutil.rmtree(partial, ignore_errors=True)
        result = write(partial)
        self.commit(name)
        return result



class RemoteStorage(_Storage):
    """A URL: complete checkpoints carry a marker object, written last (see the module doc)."""

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
            return
        except FileNotFoundError:
            pass  # a new folder (object stores have no empty folders)
        except Exception as e:
            raise CheckpointError(f"checkpoint location {self.location} is unreachable: {one_line(e)}") from None
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

    def steps(self) -> list[int]:
        return sorted(int(STEP_DIR.match(name).group(1)) for name in self._children()
                      if STEP_DIR.match(name) and self.fs.exists(self._path(name, COMPLETE_MARKER)))

    def _children(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def target(self, name: str) -> str:
        """Where every rank writes ``name`` (once rank 0 has begun it): the final place, marked complete later."""
        return self.where(name)

    def begin(self, name: str) -> None:
        self.delete(name)  # whatever an interrupted save of this step left
        self.fs.makedirs(self._path(name), exist_ok=True)

    def commit(self, name: str) -> None:
        self.fs.pipe_file(self._path(name, COMPLETE_MARKER), b"complete\n")

    def delete(self, name: str) -> None:
        marker = self._path(name, COMPLETE_MARKER)
        if self.fs.exists(marker):
            self.fs.rm(marker)
        if self.fs.exists(self._path(name)):
            self.fs.rm(self._path(name), recursive=True)

    def remove_incomplete(self) -> None:
        for name in self._children():
            if not (STEP_DIR.match(name) or name.startswith("export-step-")) or \
                    self.fs.exists(self._path(name, COMPLETE_MARKER)):
                continue
            if self.fs.exists(self._path(name, METADATA_FILE)):
                # Written to the end but not marked (or copied here from elsewhere): never loaded, but not
                # ours to delete unasked either.
                logger.warning(f"{self.where(name)} has no {COMPLETE_MARKER} marker, so it is not loaded; it holds "
                               f"{METADATA_FILE}: if it is a complete checkpoint, add the marker, else delete it")
                continue
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
