"""Folders and files the scripts write for users (Hugging Face exports, PEFT adapters, converted checkpoints,
tokenizers, generated configs): nothing a user had there is ever overwritten or removed.

A folder is written only when it is new or empty, and whole: everything goes into a hidden folder first, which
becomes the output once complete, so a run that fails or is killed leaves the folder as it was (a leftover
``.partial-PID`` folder is the script's own, safe to remove). A new folder's partial one is its sibling, renamed into
place at once; an empty one's lies inside it (its parent may not be writable: a mount point, a container volume),
and its entries move up, each by a rename. Anything already in the folder, even an earlier output of the same
script, is refused before a byte is written: the script cannot tell a file it wrote from one the user put there,
and replacing a folder is one ``rm -r`` for the user who means it.

A generated file (a config) is replaced only while it is as the script wrote it: its first line records a hash of
the rest (``generated_header``), so a file the user edited since is refused like any other.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputError(Exception):
    """An output path the script may not write, or could not; the message says why."""


def folder_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` may not be written (it is a file, or holds something), else None: new or empty."""
    folder = Path(folder)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return "is an existing file; give the path of a new or empty folder"
    entries = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if entries:
        more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
        return (f"holds {entries[0]!r}{more}; give a new or empty folder (nothing in it is overwritten: to replace "
                "an earlier output, remove it first)")
    return None


@contextmanager
def written_whole(folder: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder to write into, which becomes ``folder`` once the block completes; removed (and ``folder``
    left as it was) if the block raises. ``folder`` must be new or empty (OutputError otherwise), when asked and
    again at the end, so nothing that arrived meanwhile is replaced; a file system that refuses (no permission, no
    space) is an OutputError naming the folder too."""
    folder = Path(folder).absolute()
    if problem := folder_problem(folder):
        raise OutputError(f"{folder} {problem}")
    existed = folder.is_dir()
    partial = folder / f".partial-{os.getpid()}" if existed else folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    try:
        shutil.rmtree(partial, ignore_errors=True)  # this process's own, from a PID reused after a kill
        partial.mkdir(parents=True)
    except OSError as e:
        raise OutputError(f"cannot write into {folder}: {type(e).__name__}: {e.strerror or e}") from None
    try:
        yield partial
        others = folder_problem(folder) if not existed else [p for p in folder.iterdir() if p != partial]
        if others:
            raise OutputError(f"{folder} was written to while this script ran; nothing of it is replaced")
        if existed:
            for entry in sorted(partial.iterdir()):
                os.rename(entry, folder / entry.name)
            partial.rmdir()
        else:
            os.rename(partial, folder)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise OutputError(f"cannot write {folder}: {type(e).__name__}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def generated_header(marker: str, body: str) -> str:
    """The first line of a generated file: ``marker`` and a hash of ``body`` (what follows the line), by which
    ``file_problem`` knows the file is still as written."""
    return f"{marker} (sha256 of the rest: {hashlib.sha256(body.encode()).hexdigest()[:16]})\n"


def file_problem(path: str | os.PathLike, marker: str) -> str | None:
    """Why the file ``path`` may not be written: it is a folder, or it exists but is not a file this script generated
    (its first line ``marker`` with the hash of the rest, ``generated_header``) as it generated it; else None."""
    path = Path(path)
    if path.is_dir():
        return "is a folder; give the path of a file"
    if not path.exists():
        return None
    try:
        first, _, rest = path.read_text().partition("\n")
    except (OSError, UnicodeDecodeError):
        first, rest = "", ""
    if not first.startswith(marker):
        return "exists and was not written by this script; give another path (or remove it first)"
    if generated_header(marker, rest) != first + "\n":
        return "was written by this script but edited since; give another path (or remove it first)"
    return None
