"""Folders and files the scripts write for users (Hugging Face exports, PEFT adapters, converted checkpoints,
tokenizers, generated configs): nothing a user had there is ever overwritten or removed.

A folder is written only when it is new or empty, and whole: everything goes into a fresh sibling folder first,
which takes the folder's place once complete (one rename), so a run that fails or is killed leaves the folder as it
was (a leftover ``.NAME.partial-PID`` sibling is the script's own, safe to remove). Anything already in the folder,
even an earlier export of the same script, is refused before a byte is written: the script cannot tell a file it
wrote from one the user put there, and replacing a folder is one ``rm -r`` for the user who means it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def file_problem(path: str | os.PathLike, written_by: str) -> str | None:
    """Why the file ``path`` may not be written: it exists and does not start with ``written_by`` (the first line
    the script writes into every file it generates), or it is a folder; else None."""
    path = Path(path)
    if path.is_dir():
        return "is a folder; give the path of a file"
    if path.exists():
        with open(path, "rb") as f:
            first = f.read(len(written_by.encode()))
        if first != written_by.encode():
            return "exists and was not written by this script; give another path (or remove it first)"
    return None


class OutputError(Exception):
    """An output path the script may not write; the message says why."""


@contextmanager
def written_whole(folder: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder to write into, which becomes ``folder`` once the block completes; removed (and ``folder``
    left as it was) if the block raises. ``folder`` must be new or empty (OutputError otherwise), when asked and
    again at the end, so nothing that arrived meanwhile is replaced."""
    folder = Path(folder)
    if problem := folder_problem(folder):
        raise OutputError(f"{folder} {problem}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)  # this process's own, from a PID reused after a kill
    partial.mkdir()
    try:
        yield partial
        if problem := folder_problem(folder):
            raise OutputError(f"{folder} {problem} (it was written to while this script ran)")
        if folder.is_dir():
            folder.rmdir()  # empty: checked just above; rmdir itself refuses a folder that is not
        os.rename(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
