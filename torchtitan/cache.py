"""Where torchtitan keeps what it measures, builds or copies once per machine (CPU peak, expert kernels' timings,
compiled kernels, local copies of remote data and weights)."""

import fcntl
import json
import os
import shutil
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
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if need be): other processes on this machine wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
        return cache[key], True


def filled_once(folder: Path, marker: str, content: bytes, fill: Callable[[Path], None]) -> Path:
    """``folder`` (in the cache), filled by ``fill(folder)`` once per machine: the first process fills it under a
    file lock while the others wait, then reuse it. It counts as complete only when its file ``marker`` holds
    ``content``, written last (atomically); otherwise (an interrupted copy, or ``content`` changed: another
    version of the source) it is emptied and filled again."""
    done = folder / marker
    with locked(folder.with_suffix(".lock")):
        if done.is_file() and done.read_bytes() == content:
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        fill(folder)
        tmp = folder / f"{marker}.tmp"
        tmp.write_bytes(content)
        os.replace(tmp, done)
    return folder
