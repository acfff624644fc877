"""Pre-tokenized data: documents as token ids in memory-mapped shards, with a document index and a manifest.

A shard folder holds ``manifest.json`` and, per shard, ``tokens-NNNNN.bin`` (the token ids of its documents
end to end, uint16 when the vocabulary fits, else uint32) and ``tokens-NNNNN.idx`` (int64 offsets: document
i of the shard is ``tokens[idx[i]:idx[i + 1]]``). Each document is stored as the text source packs it: BOS +
tokens + EOS, empty documents left out, so a `TokenShards` folder is a drop-in document source for
PackedTokenDataset and gives the very stream on-the-fly tokenization gives (data/dataset.py).

Writing is deterministic (documents in source order, shards cut at fixed token counts, no timestamps), so the
same input and tokenizer give byte-identical files. The folder is written as ``NAME.partial`` (marked as ours by
a file in it) and renamed when complete; it replaces only a folder this writer made (its manifest lists every
file in it), and a failed write removes its partial folder. The manifest records the tokenizer file's SHA-256,
and reading refuses shards made with another tokenizer, a manifest not of the schema written here, missing or
truncated files, an index that does not fit its tokens, folders without a token (every pass over them would be
empty), and, as documents are read, token ids beyond the manifest's vocab_size.

Shards at a URL (``s3://bucket/corpus``, ``file://``, ...): memory-mapping needs local files, so the folder is
first copied into the cache folder ($TORCHTITAN_CACHE_DIR/shards/, see cache.py), once per machine (a file lock
makes the other processes wait; the manifest is read under it), and copied again only when the remote manifest
changes. An offline node reuses a complete copy, with a warning.

Order: documents are read in stored order, or, with ``shuffle_seed``, in a permutation drawn per pass over
the data from (seed, pass): windows are then cut from the shuffled document stream as usual, so resuming and
the layout independence of the packed stream are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
from collections.abc import Iterable, Iterator

import numpy as np

from torchtitan.cache import cache_dir, filled_once
from torchtitan.data.errors import DataError
from torchtitan.data.tokenizer import Tokenizer
from torchtitan.log import logger, one_line
from torchtitan.remote import filesystem, is_url, join

FORMAT = "torchtitan-tokens"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES = ("uint16", "uint32")
# In a folder being written: says it is ours, so an interrupted write's leftover may be removed by the next one.
PARTIAL_MARK = ".tokenize_dataset-partial"
_SHARD_FILE = re.compile(r"tokens-\d{5}\.(bin|idx)")
_WRITER = "scripts/tokenize_dataset.py"


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def parse_manifest(text: str | bytes, where: str) -> dict:
    """The manifest ``text`` read from ``where``, checked against the schema write_shards writes (the keys the
    reader uses, their types, file names that stay in the folder); else a one-line DataError naming the key."""
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise DataError(f"{where}: cannot read the shard manifest: {one_line(e)}") from None

    def refuse(detail: str):
        raise DataError(f"{where}: not a {FORMAT} v{VERSION} manifest (as {_WRITER} writes): {detail}")

    if not isinstance(manifest, dict):
        refuse(f"it holds {_json_kind(manifest)}, not an object")
    for key in ("format", "version", "dtype", "vocab_size", "tokenizer_file", "tokenizer_sha256", "shards"):
        if key not in manifest:
            refuse(f"key {key!r} is missing")
    if manifest["format"] != FORMAT or manifest["version"] != VERSION:
        refuse(f"format {manifest['format']!r} version {manifest['version']!r}")
    if manifest["dtype"] not in DTYPES:
        refuse(f"dtype {manifest['dtype']!r} is not one of {', '.join(DTYPES)}")
    vocab_size = manifest["vocab_size"]
    if not _is_count(vocab_size) or vocab_size == 0:
        refuse(f"vocab_size {vocab_size!r} is not a whole number >= 1")
    if vocab_size > np.iinfo(manifest["dtype"]).max + 1:
        raise DataError(f"{where}: vocab_size {vocab_size} does not fit its dtype {manifest['dtype']} (ids up to "
                        f"{np.iinfo(manifest['dtype']).max}); tokenize the data again")
    if not isinstance(manifest["shards"], list):
        refuse(f"shards is {_json_kind(manifest['shards'])}, not a list")
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            refuse(f"shards[{i}] is {_json_kind(shard)}, not an object")
        for key, valid, kind in (("tokens", _is_file_name, "a file name"), ("index", _is_file_name, "a file name"),
                                 ("num_tokens", _is_count, "a whole number >= 0"),
                                 ("num_documents", _is_count, "a whole number >= 0")):
            if key not in shard:
                refuse(f"key 'shards[{i}].{key}' is missing")
            if not valid(shard[key]):
                detail = " (the shard files lie next to the manifest)" if kind == "a file name" else ""
                refuse(f"shards[{i}].{key} {shard[key]!r} is not {kind}{detail}")
    return manifest


def _is_file_name(value) -> bool:
    return isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value


class ShardWriter:
    """Appends tokenized documents and cuts shards of about ``shard_tokens`` tokens (a document is never split)."""

    def __init__(self, folder: pathlib.Path, dtype: np.dtype, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[dict] = []
        self._pieces: list[np.ndarray] = []
        self._lengths: list[int] = []
        self._tokens = 0
        self._documents = 0

    def add(self, ids: np.ndarray) -> None:
        if len(ids) and ids.max() > np.iinfo(self.dtype).max:
            raise DataError(f"document {self._documents} has token id {int(ids.max())}, beyond {self.dtype.name} "
                            "(the tokenizer's ids exceed its vocab_size)")
        self._pieces.append(ids.astype(self.dtype, copy=False))
        self._lengths.append(len(ids))
        self._tokens += len(ids)
        self._documents += 1
        if self._tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._lengths:
            return
        name = f"tokens-{len(self.shards):05d}"
        tokens = np.concatenate(self._pieces)
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        tokens.tofile(self.folder / f"{name}.bin")
        offsets.tofile(self.folder / f"{name}.idx")
        self.shards.append({"tokens": f"{name}.bin", "index": f"{name}.idx", "num_tokens": int(len(tokens)),
                            "num_documents": len(self._lengths)})
        self._pieces, self._lengths, self._tokens = [], [], 0


def _partial(output: pathlib.Path) -> pathlib.Path:
    return output.with_name(output.name + ".partial")


def _own_files(folder: pathlib.Path) -> set[str]:
    """The names in ``folder`` that write_shards wrote: those its manifest lists (a complete folder), or shard
    files next to its mark (an interrupted one)."""
    try:
        manifest = parse_manifest((folder / MANIFEST).read_bytes(), str(folder / MANIFEST))
    except (OSError, DataError):
        manifest = None
    if manifest is not None:
        return {MANIFEST, PARTIAL_MARK, *(s[key] for s in manifest["shards"] for key in ("tokens", "index"))}
    if (folder / PARTIAL_MARK).is_file():
        return {PARTIAL_MARK, *(p.name for p in folder.iterdir() if _SHARD_FILE.fullmatch(p.name))}
    return set()


def _foreign_entries(folder: pathlib.Path) -> list[str]:
    own = _own_files(folder)
    return sorted(p.name for p in folder.iterdir() if p.name not in own or not p.is_file() or p.is_symlink())


def output_problem(output: str | os.PathLike) -> str | None:
    """Why write_shards must not write at ``output`` (it would replace or remove something it did not write), or
    None. Replaceable: nothing there, an empty folder, or a shard folder (or partial one) it wrote."""
    output = pathlib.Path(output)
    if output.is_symlink() or (output.exists() and not output.is_dir()):
        return "is an existing file; give the path of a folder to write the shards in"
    if output.is_dir() and (foreign := _foreign_entries(output)):
        return (f"holds {foreign[0]!r}" + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "") +
                f", not written by {_WRITER}; give a new or empty folder, or one it wrote (it is replaced)")
    partial = _partial(output)
    if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
        return f"needs {partial} to write into, but that is an existing file; move it away"
    if partial.is_dir() and (foreign := _foreign_entries(partial)):
        return (f"needs {partial} to write into, but that holds {foreign[0]!r}, not written by {_WRITER}; "
                "move it away")
    return None


def _remove_own(folder: pathlib.Path) -> None:
    """Remove a folder write_shards wrote, file by file: rmdir fails rather than remove anything that came since."""
    for name in _own_files(folder):
        (folder / name).unlink(missing_ok=True)
    folder.rmdir()


def write_shards(encoded: Iterable[list[int]], tokenizer: Tokenizer, output: str | os.PathLike, source: str,
                 shard_tokens: int = 1 << 28) -> dict:
    """Write the token ids of ``encoded`` documents (BOS/EOS already added; empty ones skipped by the caller)
    as a shard folder at ``output`` and return its manifest. The folder is replaced only once complete, and only
    if write_shards made it (see output_problem); a failed write leaves no partial folder."""
    output = pathlib.Path(output)
    if problem := output_problem(output):
        raise DataError(f"{output}: {problem}")
    partial = _partial(output)
    if partial.is_dir():
        _remove_own(partial)  # an interrupted write's leftover
    partial.mkdir(parents=True)
    try:
        (partial / PARTIAL_MARK).touch()
        dtype = token_dtype(tokenizer.vocab_size)
        writer = ShardWriter(partial, dtype, shard_tokens)
        for ids in encoded:
            writer.add(np.asarray(ids))
        writer.flush()
        if not writer.shards:
            raise DataError(f"{source}: no non-empty document to write; the shards would hold no tokens")
        source_file = pathlib.Path(tokenizer.source_file)
        manifest = {
            "format": FORMAT, "version": VERSION, "source": source, "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size, "tokenizer_file": source_file.name,
            "tokenizer_sha256": file_sha256(source_file), "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "num_tokens": sum(s["num_tokens"] for s in writer.shards),
            "num_documents": sum(s["num_documents"] for s in writer.shards), "shards": writer.shards,
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        (partial / PARTIAL_MARK).unlink()  # the manifest marks it as ours from here on
        if output.is_dir():
            if problem := output_problem(output):  # something came in while the data was tokenized
                raise DataError(f"{output}: {problem}")
            _remove_own(output)
        partial.rename(output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _check_index(offsets: np.ndarray, path: pathlib.Path, tokens_name: str, num_tokens: int) -> None:
    """An index must cut its shard's tokens into documents: from 0, never backwards, ending at the last token."""
    if offsets[0] != 0:
        raise DataError(f"{path}: starts at offset {offsets[0]}, not 0; tokenize the data again")
    if len(backwards := np.flatnonzero(np.diff(offsets) < 0)):
        k = int(backwards[0])
        raise DataError(f"{path}: the offset decreases at document {k} ({offsets[k]} then {offsets[k + 1]}); "
                        "tokenize the data again")
    if offsets[-1] != num_tokens:
        raise DataError(f"{path}: ends at offset {offsets[-1]}, but {tokens_name} holds {num_tokens} tokens; "
                        "tokenize the data again")


def is_shard_folder(path: str | os.PathLike) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def fetch_shards(url: str) -> pathlib.Path:
    """A local copy of the shard folder at ``url`` in the cache folder (see the module doc). The manifest is read
    under the cache lock, once for the processes that arrive together; when it cannot be read (an offline node), a
    complete copy is used as it is, with a warning, as for weights at a URL (remote.fetched_folder)."""
    local = cache_dir() / "shards" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    source = {}

    def manifest() -> bytes:
        try:
            fs, root = filesystem(url)
            text = fs.cat_file(join(root, MANIFEST))
        except Exception as e:  # unreachable, no credentials, no such folder
            if (local / MANIFEST).is_file():  # written last: the copy is whole
                logger.warning(f"cannot read {join(url, MANIFEST)} ({one_line(e)}): using the copy of the shards "
                               f"fetched earlier, {local}")
                return (local / MANIFEST).read_bytes()
            raise DataError(f"{join(url, MANIFEST)}: cannot read the shard manifest: {one_line(e)}") from None
        source.update(fs=fs, root=root, manifest=parse_manifest(text, join(url, MANIFEST)))
        return text

    def copy(local: pathlib.Path) -> None:
        fs, root, parsed = source["fs"], source["root"], source["manifest"]
        itemsize = np.dtype(parsed["dtype"]).itemsize
        for shard in parsed["shards"]:
            for key, size in (("tokens", shard["num_tokens"] * itemsize), ("index", (shard["num_documents"] + 1) * 8)):
                remote, target = join(url, shard[key]), local / shard[key]
                try:
                    fs.get_file(join(root, shard[key]), str(target))
                except Exception as e:
                    raise DataError(f"{remote}: cannot fetch it (the manifest lists it): {one_line(e)}") from None
                if target.stat().st_size != size:
                    raise DataError(f"{remote}: {target.stat().st_size} bytes, but the manifest says {size} "
                                    "(truncated or overwritten); tokenize the data again")

    # The manifest is the completion marker: a copy counts once every file it lists is in place, and a changed
    # remote manifest (the data tokenized again) makes a new copy.
    return filled_once(local, MANIFEST, manifest, copy)


class TokenShards:
    """The documents of a shard folder as token-id arrays (memory-mapped views), re-iterable in a fixed order.

    Checks on opening, each a one-line DataError naming the file: the manifest's schema, every shard and index
    present with the sizes the manifest states, each index running from 0 up to its shard's token count, some
    token at all, and (given ``tokenizer``) the tokenizer that made them. Reading a document checks its ids
    against the manifest's vocab_size (a cheap max over ids being read anyway).
    """

    def __init__(self, path: str | os.PathLike, tokenizer: Tokenizer | None = None, shuffle_seed: int | None = None):
        self.folder = fetch_shards(str(path)) if is_url(str(path)) else pathlib.Path(path)
        manifest_path = self.folder / MANIFEST
        try:
            text = manifest_path.read_bytes()
        except OSError as e:
            raise DataError(f"{manifest_path}: cannot read the shard manifest: {type(e).__name__}: {e}") from None
        self.manifest = parse_manifest(text, str(manifest_path))
        self.vocab_size = self.manifest["vocab_size"]
        if tokenizer is not None:
            self._check_tokenizer(tokenizer, manifest_path)
        dtype = np.dtype(self.manifest["dtype"])
        self._tokens, self._offsets, self._token_files = [], [], []
        for shard in self.manifest["shards"]:
            tokens_path, index_path = self.folder / shard["tokens"], self.folder / shard["index"]
            for path, expected in ((tokens_path, shard["num_tokens"] * dtype.itemsize),
                                   (index_path, (shard["num_documents"] + 1) * 8)):
                if not path.is_file():
                    raise DataError(f"{path}: missing; the manifest {manifest_path} lists it")
                if path.stat().st_size != expected:
                    raise DataError(f"{path}: {path.stat().st_size} bytes, but the manifest says {expected} "
                                    "(truncated or overwritten); tokenize the data again")
            offsets = np.fromfile(index_path, dtype=np.int64)
            _check_index(offsets, index_path, tokens_path.name, shard["num_tokens"])
            self._tokens.append(np.memmap(tokens_path, dtype=dtype, mode="r") if shard["num_tokens"] else
                                np.zeros(0, dtype=dtype))
            self._offsets.append(offsets)
            self._token_files.append(tokens_path)
        if not sum(shard["num_tokens"] for shard in self.manifest["shards"]):
            # Every pass over it would yield nothing: a loader cycling through it would never make a batch.
            raise DataError(f"{self.folder}: the shards hold no tokens ({len(self.manifest['shards'])} shard(s), "
                            "every document empty); tokenize a corpus with text")
        counts = np.array([len(o) - 1 for o in self._offsets], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)])  # global index of each shard's first document
        self.shuffle_seed = shuffle_seed

    def _check_tokenizer(self, tokenizer: Tokenizer, manifest_path: pathlib.Path) -> None:
        if tokenizer.source_file is not None:  # else a tokenizer built in code: no file to compare
            ours = pathlib.Path(tokenizer.source_file)
            theirs = (self.manifest["tokenizer_file"], str(self.manifest["tokenizer_sha256"]))
            if (ours.name, file_sha256(ours)) != theirs:
                raise DataError(f"{manifest_path}: made with tokenizer {theirs[0]} (sha256 {theirs[1][:12]}…), not "
                                f"the configured {ours} (sha256 {file_sha256(ours)[:12]}…); use that tokenizer "
                                "(model.hf_assets_path) or tokenize the data again")
        # The model's vocabulary is at least the tokenizer's (config validation), so ids below this bound fit it.
        if self.vocab_size > tokenizer.vocab_size:
            raise DataError(f"{manifest_path}: vocab_size {self.vocab_size} is larger than the configured "
                            f"tokenizer's {tokenizer.vocab_size}; use the tokenizer that made the shards")

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} is out of range for {len(self)} documents in {self.folder}")
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        local = index - int(self._first[shard])
        start, end = self._offsets[shard][local], self._offsets[shard][local + 1]
        document = np.asarray(self._tokens[shard][start:end], dtype=np.int64)
        if len(document) and (largest := int(document.max())) >= self.vocab_size:
            raise DataError(f"{self._token_files[shard]}: document {local} holds token id {largest}, beyond the "
                            f"vocabulary of {self.vocab_size} (the manifest's vocab_size); tokenize the data again")
        return document

    def order(self, epoch: int) -> np.ndarray | None:
        """The document order of pass ``epoch`` (None: stored order)."""
        if self.shuffle_seed is None:
            return None
        return np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self))

    def iter_from(self, start: int, epoch: int = 0) -> Iterator[np.ndarray]:
        """Documents start, start + 1, ... of pass ``epoch``: random access, so resuming costs nothing."""
        order = self.order(epoch)
        for i in range(start, len(self)):
            yield self[int(order[i]) if order is not None else i]

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iter_from(0)
