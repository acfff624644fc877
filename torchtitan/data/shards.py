"""Pre-tokenized data: documents as token ids in memory-mapped shards, with a document index and a manifest.

A shard folder holds ``manifest.json`` and, per shard, ``tokens-NNNNN.bin`` (the token ids of its documents
end to end, uint16 when the vocabulary fits, else uint32) and ``tokens-NNNNN.idx`` (int64 offsets: document
i of the shard is ``tokens[idx[i]:idx[i + 1]]``). Each document is stored as the text source packs it: BOS +
tokens + EOS, empty documents left out, so a `TokenShards` folder is a drop-in document source for
PackedTokenDataset and gives the very stream on-the-fly tokenization gives (data/dataset.py).

Writing is deterministic (documents in source order, shards cut at fixed token counts, no timestamps), so the
same input and tokenizer give byte-identical files. The manifest records the tokenizer file's SHA-256, and
reading refuses shards made with another tokenizer, as well as missing or truncated files.

Shards at a URL (``s3://bucket/corpus``, ``file://``, ...): memory-mapping needs local files, so the folder is
first copied into the cache folder ($TORCHTITAN_CACHE_DIR/shards/, see cache.py), once per machine (a file lock
makes the other processes wait), and copied again only when the remote manifest changes.

Order: documents are read in stored order, or, with ``shuffle_seed``, in a permutation drawn per pass over
the data from (seed, pass): windows are then cut from the shuffled document stream as usual, so resuming and
the layout independence of the packed stream are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Iterable, Iterator

import numpy as np

from torchtitan.cache import cache_dir, filled_once
from torchtitan.data.errors import DataError
from torchtitan.data.tokenizer import Tokenizer
from torchtitan.log import one_line
from torchtitan.remote import filesystem, is_url, join

FORMAT = "torchtitan-tokens"
VERSION = 1
MANIFEST = "manifest.json"


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


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


def write_shards(encoded: Iterable[list[int]], tokenizer: Tokenizer, output: str | os.PathLike, source: str,
                 shard_tokens: int = 1 << 28) -> dict:
    """Write the token ids of ``encoded`` documents (BOS/EOS already added; empty ones skipped by the caller)
    as a shard folder at ``output`` (replaced atomically) and return its manifest."""
    output = pathlib.Path(output)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    writer = ShardWriter(partial, dtype, shard_tokens)
    for ids in encoded:
        writer.add(np.asarray(ids))
    writer.flush()
    source_file = pathlib.Path(tokenizer.source_file)
    manifest = {
        "format": FORMAT, "version": VERSION, "source": source, "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size, "tokenizer_file": source_file.name,
        "tokenizer_sha256": file_sha256(source_file), "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
        "num_tokens": sum(s["num_tokens"] for s in writer.shards),
        "num_documents": sum(s["num_documents"] for s in writer.shards), "shards": writer.shards,
    }
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(output, ignore_errors=True)
    partial.rename(output)
    return manifest


def is_shard_folder(path: str | os.PathLike) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def fetch_shards(url: str) -> pathlib.Path:
    """A local copy of the shard folder at ``url`` in the cache folder (see the module doc)."""
    try:
        fs, root = filesystem(url)
        manifest = fs.cat_file(join(root, MANIFEST))
    except Exception as e:  # unreachable, no credentials, no such folder
        raise DataError(f"{join(url, MANIFEST)}: cannot read the shard manifest: {one_line(e)}") from None
    try:
        shards = json.loads(manifest)["shards"]
        itemsize = np.dtype(json.loads(manifest)["dtype"]).itemsize
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{join(url, MANIFEST)}: not a {FORMAT} manifest: {one_line(e)}") from None

    def copy(local: pathlib.Path) -> None:
        for shard in shards:
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
    local = cache_dir() / "shards" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return filled_once(local, MANIFEST, manifest, copy)


class TokenShards:
    """The documents of a shard folder as token-id arrays (memory-mapped views), re-iterable in a fixed order.

    Checks on opening, each a one-line DataError naming the file: the manifest's format, every shard and index
    present with the sizes the manifest states, and (given ``tokenizer``) the tokenizer that made them.
    """

    def __init__(self, path: str | os.PathLike, tokenizer: Tokenizer | None = None, shuffle_seed: int | None = None):
        self.folder = fetch_shards(str(path)) if is_url(str(path)) else pathlib.Path(path)
        manifest_path = self.folder / MANIFEST
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{manifest_path}: cannot read the shard manifest: {type(e).__name__}: {e}") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise DataError(f"{manifest_path}: not a {FORMAT} v{VERSION} manifest (as scripts/tokenize_dataset.py "
                            "writes)")
        if tokenizer is not None:
            self._check_tokenizer(tokenizer, manifest_path)
        dtype = np.dtype(self.manifest["dtype"])
        self._tokens, self._offsets = [], []
        for shard in self.manifest["shards"]:
            tokens_path, index_path = self.folder / shard["tokens"], self.folder / shard["index"]
            for path, expected in ((tokens_path, shard["num_tokens"] * dtype.itemsize),
                                   (index_path, (shard["num_documents"] + 1) * 8)):
                if not path.is_file():
                    raise DataError(f"{path}: missing; the manifest {manifest_path} lists it")
                if path.stat().st_size != expected:
                    raise DataError(f"{path}: {path.stat().st_size} bytes, but the manifest says {expected} "
                                    "(truncated or overwritten); tokenize the data again")
            self._tokens.append(np.memmap(tokens_path, dtype=dtype, mode="r") if shard["num_tokens"] else
                                np.zeros(0, dtype=dtype))
            self._offsets.append(np.fromfile(index_path, dtype=np.int64))
        counts = np.array([len(o) - 1 for o in self._offsets], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)])  # global index of each shard's first document
        self.shuffle_seed = shuffle_seed

    def _check_tokenizer(self, tokenizer: Tokenizer, manifest_path: pathlib.Path) -> None:
        if tokenizer.source_file is None:
            return  # a tokenizer built in code: nothing to compare
        ours = pathlib.Path(tokenizer.source_file)
        theirs = (self.manifest.get("tokenizer_file"), str(self.manifest.get("tokenizer_sha256")))
        if (ours.name, file_sha256(ours)) != theirs:
            raise DataError(f"{manifest_path}: made with tokenizer {theirs[0]} (sha256 {theirs[1][:12]}…), not the "
                            f"configured {ours} (sha256 {file_sha256(ours)[:12]}…); use that tokenizer "
                            "(model.hf_assets_path) or tokenize the data again")

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} is out of range for {len(self)} documents in {self.folder}")
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        local = index - int(self._first[shard])
        start, end = self._offsets[shard][local], self._offsets[shard][local + 1]
        return np.asarray(self._tokens[shard][start:end], dtype=np.int64)

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
