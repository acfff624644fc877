"""Document sources: the pydocs corpus, local files in every format, hub names offline, and bad data."""

import gzip
import itertools
import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TOKENIZER
from torchtitan.data import DataError, build_dataloader, build_tokenizer, load_documents, load_pydocs_documents, pydocs
from torchtitan.data.sources import HUB_DATASETS, registered_datasets

DOCS = ["first document", "", "naïve 数据 🙂", "third\twith tab", "last one"]


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHTITAN_CACHE_DIR", str(cache))
        yield pydocs.pydocs_corpus_path()


# --- pydocs corpus ---


def test_corpus_is_deterministic_and_cached_atomically(corpus_cache, tmp_path, monkeypatch):
    cached = corpus_cache.read_bytes()
    assert len(cached) > 1_000_000
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path))
    rebuilt = pydocs.pydocs_corpus_path()
    assert rebuilt.read_bytes() == cached
    assert os.listdir(rebuilt.parent) == [rebuilt.name]
    assert str(tmp_path) in str(rebuilt) and f"v{pydocs.FORMAT_VERSION}" in rebuilt.name


def test_failed_write_leaves_no_file(tmp_path):
    target = tmp_path / "corpus.jsonl"
    with pytest.raises(TypeError):
        pydocs._write_atomically(target, ["fine", object()])
    assert os.listdir(tmp_path) == []


def test_splits_are_disjoint_and_cover_corpus(corpus_cache, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(corpus_cache.parent.parent))
    everything = [json.loads(line)["text"] for line in corpus_cache.open(encoding="utf-8")]
    train, validation = load_pydocs_documents("train"), load_pydocs_documents("validation")
    assert validation == everything[:: pydocs.VALIDATION_EVERY]
    assert len(train) + len(validation) == len(everything)
    assert not set(train) & set(validation)
    assert all(len(doc) >= pydocs.MIN_DOC_CHARS for doc in everything)
    with pytest.raises(DataError, match="'test'.*train.*validation"):
        load_pydocs_documents("test")


# --- local files ---


def write(path, docs, column="text"):
    """Write docs as the file type path's suffix names; return the path as a string."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz", ".json")):
        text = "".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs))
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.write(text)
    elif name.endswith(".parquet"):
        pq.write_table(pa.table({column: docs}), path)
    elif name.endswith(".arrow"):
        table = pa.table({column: docs})
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            writer.write_table(table)
    else:
        path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.json", "d.parquet", "d.arrow", "d.txt"])
def test_every_local_format_reads_the_same_documents(tmp_path, name):
    path = write(tmp_path / name, DOCS)
    assert list(load_documents("ignored", path, "train")) == DOCS
    assert list(load_documents("ignored", path, "train")) == DOCS  # re-iterable


def test_a_folder_reads_its_data_files_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    write(tmp_path / "b" / "2.parquet", ["b2"])
    write(tmp_path / "a.jsonl", ["a"])
    write(tmp_path / "b" / "10.txt", ["b10"])
    write(tmp_path / "c.arrow", ["c"])
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / ".hidden.jsonl").write_text("{}\n")
    assert list(load_documents("ignored", str(tmp_path), "train")) == ["a", "b10", "b2", "c"]


def test_the_text_column_is_configurable(tmp_path):
    path = write(tmp_path / "d.parquet", DOCS, column="content")
    assert list(load_documents("x", path, "train", text_column="content")) == DOCS
    tokenizer = build_tokenizer(str(TOKENIZER))
    loader = build_dataloader(tokenizer, dataset="x", dataset_path=path, seq_len=8, local_batch_size=1,
                              dp_rank=0, dp_world_size=1, text_column="content")
    text = tokenizer.decode(next(iter(loader))[0][0].tolist())
    assert text.startswith("<|begin_of_text|>first document<|end_of_text|><|begin_of_text|>")


# --- bad data: one line naming the file and the row ---


def bad_case(tmp_path, kind):
    if kind == "number":
        write(tmp_path / "d.jsonl", ["a", "b", "c"])
        return _append(tmp_path / "d.jsonl", '{"text": 5}\n'), 3
    if kind == "null":
        pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "d.parquet")
        return str(tmp_path / "d.parquet"), 1
    if kind == "bad_json":
        path = tmp_path / "d.jsonl"
        write(path, ["a", "b"])
        _append(path, "{not json\n")
        _append(path, '{"text": "c"}\n')
        return str(path), 2
    if kind == "missing_column":
        return write(tmp_path / "d.jsonl", ["a"], column="content"), 0
    if kind == "corrupt_parquet":
        (tmp_path / "d.parquet").write_bytes(b"PAR1 not really parquet")
        return str(tmp_path / "d.parquet"), 0
    raise AssertionError(kind)


def _append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
    return str(path)


BAD = {
    "number": "column 'text' holds int 5, not text",
    "null": "has no value in column 'text' (missing or null)",
    "bad_json": "cannot read: ArrowInvalid",
    "missing_column": "has no column 'text' (columns: content, id); set dataset_text_column",
    "corrupt_parquet": "cannot read:",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_data_names_file_and_row(tmp_path, kind):
    path, row = bad_case(tmp_path, kind)
    with pytest.raises(DataError) as error:
        list(load_documents("x", path, "train"))
    message = str(error.value)
    assert message.startswith(f"{path}: row {row}") and BAD[kind] in message, message
    assert "\n" not in message


def test_a_bad_row_met_by_a_worker_mid_stream_keeps_its_message(tmp_path):
    path = tmp_path / "d.jsonl"
    write(path, [f"document number {i}" for i in range(200)])
    _append(path, '{"text": ["not", "text"]}\n')
    tokenizer = build_tokenizer(str(TOKENIZER))
    loader = build_dataloader(tokenizer, dataset="x", dataset_path=str(path), seq_len=16, local_batch_size=2,
                              dp_rank=0, dp_world_size=1, num_workers=2)
    it = iter(loader)
    next(it)  # the first batches are fine
    with pytest.raises(DataError) as error:
        for _ in it:
            pass
    assert str(error.value) == f"{path}: row 200: column 'text' holds list ['not', 'text'], not text"


def test_dataset_paths_without_data_are_rejected(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"notes\.csv' has an unsupported file type; valid: \.jsonl, .*\.txt\.gz"):
        load_documents("x", str(tmp_path / "notes.csv"), "train")
    with pytest.raises(DataError, match="holds no data files"):
        load_documents("x", str(tmp_path), "train")
    with pytest.raises(DataError, match="does not exist"):
        load_documents("x", str(tmp_path / "missing"), "train")
    with pytest.raises(DataError, match="unknown dataset 'nope'; registered datasets: arithmetic_chat, c4, "
                                        "c4_validation"):
        load_documents("nope", None, "train")


# --- hub datasets (never reached in tests: HF_HUB_OFFLINE=1) ---


def test_hub_datasets_are_registered_and_fail_fast_offline():
    assert {"pydocs", "c4", "c4_validation", "fineweb-edu", "wikitext-103"} <= set(registered_datasets())
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    start = time.monotonic()
    with pytest.raises(DataError, match=r"hub dataset allenai/c4 \(en, split validation\): cannot open: .*HF_TOKEN"):
        list(itertools.islice(load_documents("c4_validation", None, "train"), 1))
    assert time.monotonic() - start < 10
    assert HUB_DATASETS["wikitext-103"]("validation").split == "validation"
    with pytest.raises(DataError, match="no 'validation' split here; valid: train"):
        load_documents("fineweb-edu", None, "validation")


class _BlockReader:
    """A reader that refuses the whole file at once, as newer pyarrow does for a column whose type changes."""

    def iter(self, batch_size):
        raise ValueError("JSON parse error: Column(/text) changed from string to number in row 3")
        yield


@pytest.mark.parametrize("kind,expected", [("number", "column 'text' holds int 5, not text"),
                                           ("bad_json", "cannot read: ValueError: JSON parse error")])
def test_a_reader_failing_on_a_whole_block_still_names_the_row(tmp_path, kind, expected):
    from torchtitan.data.sources import _first_bad_json_line, _stream_texts

    path, row = bad_case(tmp_path, kind)
    with pytest.raises(DataError) as error:
        list(_stream_texts(_BlockReader, path, "text", lambda: _first_bad_json_line(path, "text", "text")))
    assert str(error.value).startswith(f"{path}: row {row}: {expected}"), error.value


def test_the_row_locator_survives_a_truncated_gzip(tmp_path):
    from torchtitan.data.sources import _first_bad_json_line

    path = tmp_path / "d.jsonl.gz"
    write(path, ["a", "b"] * 200)
    path.write_bytes(path.read_bytes()[:40])
    assert _first_bad_json_line(str(path), "text", "text") is None  # the reader's own error is reported
