"""``python -m torchtitan.train`` with two test filesystems registered, for checkpoints and data at URLs.

- ``objstore://``: a stand-in for an object store that several processes share (``memory://`` is per process):
  its objects are files under $OBJSTORE_ROOT, and it refuses to rename folders, as object stores cannot.
- ``unreachable://``: every call fails as a store would with no network.

Several runs may share one process (``memory://`` lives as long as the process): separate them with ``--then``.
A segment ``rm URL`` deletes that object instead of training (e.g. a completion marker), ``touch URL`` writes an
empty one (e.g. the in-progress marker a save cut short leaves); ``steps URL`` prints
``steps: [...]``, the complete checkpoints there. Exits with the first non-zero status.
"""

import os
import sys

import fsspec
from fsspec.implementations.local import LocalFileSystem

from torchtitan.components.checkpointing.checkpoint import complete_steps
from torchtitan.train import main


class ObjectStore(LocalFileSystem):
    protocol = "objstore"
    root_marker = ""

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True)  # writing an object needs no folder made first

    @classmethod
    def _strip_protocol(cls, path):
        root, path = os.environ["OBJSTORE_ROOT"].rstrip("/"), str(path)
        if path.startswith("objstore://"):
            path = path[len("objstore://"):]
        elif path == root or path.startswith(root + "/"):
            return path  # already a path of ours, as ls and find return them
        return f"{root}/{path.strip('/')}".rstrip("/")

    def mv(self, path1, path2, **kwargs):
        if self.isdir(path1):
            raise OSError(f"objstore: cannot rename the folder {path1}: object stores have no rename")
        super().mv(path1, path2, **kwargs)

    rename = mv


class Unreachable(fsspec.AbstractFileSystem):
    protocol = "unreachable"

    def _fail(self, *args, **kwargs):
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    ls = info = makedirs = mkdir = _open = _fail


def register() -> None:
    fsspec.register_implementation("objstore", ObjectStore, clobber=True)
    fsspec.register_implementation("unreachable", Unreachable, clobber=True)


def run(argv: list[str]) -> int:
    segments, current = [], []
    for arg in argv:
        if arg == "--then":
            segments.append(current)
            current = []
        else:
            current.append(arg)
    segments.append(current)
    for segment in segments:
        if segment[:1] == ["rm"]:
            fs, path = fsspec.core.url_to_fs(segment[1])
            fs.rm(path)
            continue
        if segment[:1] == ["touch"]:
            fs, path = fsspec.core.url_to_fs(segment[1])
            fs.pipe_file(path, b"")
            continue
        if segment[:1] == ["steps"]:
            print(f"steps: {complete_steps(segment[1])}", flush=True)
            continue
        status = main(segment)
        if status:
            return status
    return 0


if __name__ == "__main__":
    register()
    sys.exit(run(sys.argv[1:]))
