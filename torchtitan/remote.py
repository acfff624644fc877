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

from torchtitan.log import logger, one_line

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


# What fsspec implementations report that changes when an object is rewritten (s3: ETag, LastModified; gcs: etag,
# generation; local and memory: mtime or created; hf: the blob's id and commit); size for the rest.
_VERSION_KEYS = ("size", "ETag", "etag", "LastModified", "last_modified", "updated", "generation", "md5Hash", "mtime",
                 "created", "blob_id", "last_commit")


def _version(info: dict) -> str:
    return " ".join(f"{key}={info[key]}" for key in _VERSION_KEYS if info.get(key) is not None)


@contextmanager
def fetched_folder(location: str, *patterns: str) -> Iterator[Path]:
    """A local folder holding ``location``'s files that match one of ``patterns``: the folder itself when it is local,
    else a copy of the URL's matching top-level files in the cache folder ($TORCHTITAN_CACHE_DIR/fetched/),
    made once per machine: the first process lists and copies under a file lock (the others wait and reuse its
    work) and marks the copy complete last. Weights of a large model are read by every rank of a node; one copy
    serves them.

    The copy is kept for the remote files as listed now (names, sizes, ETags or modification times): once one
    of them changes (e.g. a broken file is repaired), the next call copies them again. When the URL cannot be
    listed (an offline node), a complete copy is used as it is, with a warning."""
    if not is_url(location):
        yield Path(location)
        return
    from torchtitan.cache import cache_dir, filled_once

    pattern = " or ".join(patterns)  # in messages
    key = "|".join(patterns)
    local = cache_dir() / "fetched" / hashlib.sha256(f"{location.rstrip('/')}|{key}".encode()).hexdigest()[:16]
    complete = local / ".complete"
    remote = {}

    def versions() -> bytes:
        try:
            fs, root = filesystem(location)
            listed = sorted(((info["name"], info) for info in fs.ls(root, detail=True)
                             if info.get("type") != "directory"
                             and any(fnmatch.fnmatch(info["name"].rstrip("/").rsplit("/", 1)[-1], p)
                                     for p in patterns)),
                            key=lambda entry: entry[0])
        except Exception as e:
            if complete.is_file():  # written last: the copy is whole
                logger.warning(f"cannot list {location} ({one_line(e)}): using the copy of its {pattern} fetched "
                               f"earlier, {local}")
                return complete.read_bytes()
            raise RemoteError(f"{location}: cannot list {pattern}: {one_line(e)}") from None
        if not listed:
            raise RemoteError(f"{location}: holds no {pattern} files")
        remote.update(fs=fs, listed=listed)
        return (f"{location}\n" + "".join(f"{name} {_version(info)}\n" for name, info in listed)).encode()

    def copy(folder: Path) -> None:
        try:
            for name, _ in remote["listed"]:
                remote["fs"].get_file(name, str(folder / name.rstrip("/").rsplit("/", 1)[-1]))
        except Exception as e:
            raise RemoteError(f"{location}: cannot fetch {pattern}: {one_line(e)}") from None

    filled_once(local, complete.name, versions, copy)
    yield local
