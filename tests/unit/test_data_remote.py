"""Data at URLs (fsspec): text files streamed, shard folders copied once into the cache, one-line errors."""

import uuid

import fsspec
import numpy as np
import pytest

from tests.integration.remote_trainer import register
from tests.unit.test_data_sources import bad_case, write
from tests.unit.test_data_shards import loader, take, tokenize
from torchtitan.data import DataError, build_tokenizer
from torchtitan.data.shards import TokenShards
from torchtitan.data.sources import load_documents

DOCS = ["first document", "second, a little longer", "third"]


@pytest.fixture
def memory():
    """A fresh memory:// folder and the memory filesystem."""
    return f"memory://data-{uuid.uuid4().hex}", fsspec.filesystem("memory")


def upload(fs, local, url):
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{url.removeprefix('memory:/')}/{path.relative_to(local).as_posix()}", path.read_bytes())


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_folder_of_files_at_a_url_reads_as_the_local_folder(tmp_path, memory, scheme):
    local = tmp_path / "corpus"
    (local / "b").mkdir(parents=True)
    write(local / "a.jsonl", DOCS[:2])
    write(local / "b" / "c.parquet", DOCS[2:])
    (local / "README.md").write_text("not data")
    url = local.as_uri() if scheme == "file" else memory[0]
    if scheme == "memory":
        upload(memory[1], local, url)
    assert list(load_documents("x", url, "train")) == list(load_documents("x", str(local), "train")) == DOCS
    assert list(load_documents("x", f"{url}/a.jsonl", "train")) == DOCS[:2]


def test_a_bad_row_at_a_url_names_the_url_and_row(tmp_path, memory):
    path, row = bad_case(tmp_path, "bad_json")
    url = f"{memory[0]}/d.jsonl"
    memory[1].pipe_file(url.removeprefix("memory:/"), open(path, "rb").read())
    with pytest.raises(DataError, match=f"^{url}: row {row}: cannot read: ArrowInvalid"):
        list(load_documents("x", url, "train"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards") / "pydocs"
    tokenize(folder, "--shard_tokens", "1000")
    return folder


def test_shards_at_a_url_are_copied_once_and_give_the_local_stream(shards, memory, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    url, fs = memory
    upload(fs, shards, url)
    tokenizer = build_tokenizer("assets/tokenizer")
    ours = take(loader(tokenizer, url), 3)
    local = take(loader(tokenizer, shards), 3)
    assert all(np.array_equal(a, b) for x, y in zip(ours, local) for a, b in zip(x, y))
    fetched = []
    real = fs.get_file
    monkeypatch.setattr(fs, "get_file", lambda *a, **k: (fetched.append(a[0]), real(*a, **k)))
    assert len(TokenShards(url, tokenizer)) == len(TokenShards(shards))  # the cached copy: nothing fetched
    assert fetched == []
    fs.pipe_file(f"{url.removeprefix('memory:/')}/manifest.json",
                 (shards / "manifest.json").read_bytes().replace(b'"source"', b'"source" ', 1))
    TokenShards(url, tokenizer)  # the remote manifest changed: copied again
    assert len(fetched) == 2 * len(list(shards.glob("*.bin")))


def test_a_truncated_shard_at_a_url_is_refused_naming_it_and_leaves_no_usable_copy(shards, memory, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    url, fs = memory
    upload(fs, shards, url)
    fs.pipe_file(f"{url.removeprefix('memory:/')}/tokens-00001.bin", b"\0" * 10)
    with pytest.raises(DataError, match=rf"^{url}/tokens-00001.bin: 10 bytes, but the manifest says \d+ "
                                        r"\(truncated or overwritten\); tokenize the data again$"):
        TokenShards(url)
    assert not list((tmp_path / "cache").rglob("manifest.json"))


def test_unreachable_data_urls_are_one_line_errors():
    register()
    with pytest.raises(DataError, match="^dataset_path 'unreachable://bucket/corpus': cannot reach it: "
                                        r"ConnectionRefusedError: \[Errno 111\] Connection refused$"):
        load_documents("x", "unreachable://bucket/corpus", "train")
    with pytest.raises(DataError, match="^unreachable://bucket/shards/manifest.json: cannot read the shard "
                                        "manifest: ConnectionRefusedError"):
        TokenShards("unreachable://bucket/shards")
