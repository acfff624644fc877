"""Where torchtitan keeps what it measures, builds or copies once per machine (CPU peak, expert kernels' timings,
compiled kernels, local copies of remote data and weights)."""

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """$TORCHTITAN_CACHE_DIR, else $XDG_CACHE_HOME/torchtitan, else ~/.cache/torchtitan."""
    if root := os.environ.get("TORCHTITAN_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtitan"


@contextmanager
def locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on the file ``path`` (created if need be): other processes on this machine wait.
    Yields whether this one had to wait (another held the lock when it asked)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited = True
        yield waited


def measured_once(file_name: str, key: str, measure: Callable[[], Any],
                  keep: Callable[[Any], bool] = lambda value: True) -> tuple[Any, bool]:
    """(the value cached under ``key`` in the JSON file ``file_name`` of the cache folder, else ``measure()``
    stored there; whether it was measured now). A file lock makes concurrent processes wait for one
    measurement instead of all measuring at once (and slowing each other down); the file is replaced whole.
    A value ``keep`` refuses (e.g. a verdict within the noise) is returned but not stored: measured again."""
    path = cache_dir() / file_name
    with locked(path.with_suffix(".lock")):
        cache = json.loads(path.read_text()) if path.exists() else {}
        if key in cache:
            return cache[key], False
        value = measure()
        if not keep(value):
            return value, True
        cache[key] = value
        _write_json(path, cache)
        return cache[key], True


def _write_json(path: Path, cache: dict) -> None:
    """Replace ``path`` whole, so a reader without the lock never sees half a file."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)


def filled_once(folder: Path, marker: str, content: bytes | Callable[[], bytes], fill: Callable[[Path], None]) -> Path:
    """``folder`` (in the cache), filled by ``fill(folder)`` once per machine: the first process fills it under a
    file lock while the others wait, then reuse it. It counts as complete only when its file ``marker`` holds
    ``content``, written last (atomically); otherwise (an interrupted copy, or ``content`` changed: another
    version of the source) it is emptied and filled again.

    ``content`` may be a function (e.g. listing the source's versions), called under the lock. A process that
    waited while another one checked the folder takes that check as its own instead of calling it again, so the
    processes a launch starts together (the ranks of a node) call it once."""
    done, checked = folder / marker, folder.with_suffix(".checked")  # checked: rewritten by every check
    seen = _read(checked)
    with locked(folder.with_suffix(".lock")) as waited:
        check = content if callable(content) else None
        if check is not None:
            if waited and done.is_file() and _read(checked) != seen:
                return folder
            content = check()
        if not (done.is_file() and done.read_bytes() == content):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            fill(folder)
            _write(folder / f"{marker}.tmp", done, content)
        if check is not None:
            _write(folder.with_suffix(".checked.tmp"), checked, uuid.uuid4().hex.encode())
    return folder


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _write(tmp: Path, path: Path, content: bytes) -> None:
    """Replace ``path`` whole: a reader sees the old content or the new, never a part."""
    tmp.write_bytes(content)
    os.replace(tmp, path)
