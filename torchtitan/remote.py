"""Locations that may be URLs (``s3://``, ``gs://``, ``hf://``, ``file://``, ``memory://`` …), reached through fsspec.

A location is a URL when it starts with ``protocol://``; anything else is a local path and is read and written
with the standard library as before. fsspec picks the implementation from the protocol (s3fs for ``s3://``,
gcsfs for ``gs://``, huggingface_hub for ``hf://``); credentials come from the usual places (environment,
config files), as that implementation reads them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torchtitan.log import one_line

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: str | None) -> bool:
    return location is not None and bool(_URL.match(str(location)))


def url_problem(url: str) -> str | None:
    """Why fsspec cannot handle ``url`` on this machine (unknown protocol, missing package), else None.

    Looks only at the protocol: nothing is contacted, so this is safe in config validation.
    """
    from fsspec.core import split_protocol
    from fsspec.registry import get_filesystem_class

    protocol = split_protocol(url)[0]
    try:
        get_filesystem_class(protocol)
    except ValueError:
        return f"has the unknown protocol {protocol!r} (no fsspec implementation is registered for it)"
    except ImportError as e:
        return f"needs a package for {protocol}:// that is not installed: {one_line(e)}"
    return None


def filesystem(url: str):
    """The fsspec filesystem for ``url`` and the path within it."""
    from fsspec.core import url_to_fs

    return url_to_fs(url)


def join(location: str, *names: str) -> str:
    """``location/name/...`` for URLs and paths alike (URLs always use '/')."""
    return "/".join([str(location).rstrip("/"), *names])


class RemoteError(Exception):
    """A URL cannot be reached or read; the message names it."""


@contextmanager
def fetched_folder(location: str, pattern: str) -> Iterator[Path]:
    """A local folder holding ``location``'s files that match ``pattern``: the folder itself when it is local,
    else a copy of the URL's matching top-level files in the cache folder ($TORCHTITAN_CACHE_DIR/fetched/),
    made once per machine: the first process copies under a file lock (the others wait and reuse it) and marks
    the copy complete last. Weights of a large model are read by every rank of a node; one copy serves them."""
    if not is_url(location):
        yield Path(location)
        return
    from torchtitan.cache import cache_dir, filled_once

    def copy(local: Path) -> None:
        try:
            fs, root = filesystem(location)
            names = [p for p in fs.ls(root, detail=False) if fnmatch.fnmatch(p.rstrip("/").rsplit("/", 1)[-1], pattern)]
            for name in names:
                fs.get_file(name, str(local / name.rstrip("/").rsplit("/", 1)[-1]))
        except Exception as e:
            raise RemoteError(f"{location}: cannot fetch {pattern}: {one_line(e)}") from None
        if not names:
            raise RemoteError(f"{location}: holds no {pattern} files")

    local = cache_dir() / "fetched" / hashlib.sha256(f"{location.rstrip('/')}|{pattern}".encode()).hexdigest()[:16]
    filled_once(local, ".complete", f"{location}\n".encode(), copy)
    yield local
