import json
import os
import pathlib
import pickle
import random

import pytest
import torch

from torchtitan.data import build_dataloader, build_tokenizer, load_pydocs_documents, pydocs, register_dataset
from torchtitan.data.dataset import PackedTokenDataset, registered_datasets

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parents[2] / "assets" / "tokenizer"
# Includes non-ASCII text, whitespace runs and a special-token string that must stay plain text.
WORDS = "the of data model loss token rank python é 数据 🙂 def".split() + ["<|end_of_text|>", "\t\n"]


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")  # shown by pytest when a test fails
    return random.Random(seed)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHTITAN_CACHE_DIR", str(cache))
        path = pydocs.pydocs_corpus_path()
        yield path


def random_documents(rng, count):
    return [" ".join(rng.choices(WORDS, k=rng.randrange(0, 40))) for _ in range(count)]


def write_jsonl(path, documents):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    return str(path)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


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
    with pytest.raises(ValueError, match="'test'.*train.*validation"):
        load_pydocs_documents("test")


# --- tokenizer ---


def test_tokenizer_round_trip_and_special_ids(tokenizer, rng):
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.bos_id, tokenizer.eos_id) != (None, None) and tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.pad_id is not None and tokenizer.pad_id not in (tokenizer.bos_id, tokenizer.eos_id)
    texts = random_documents(rng, 20) + ["", "  leading spaces\r\n", "".join(map(chr, range(1, 300)))]
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        # Special-token strings inside text stay text: only the wrapper adds BOS/EOS.
        assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
        assert tokenizer.encode(text, bos=True, eos=True) == [tokenizer.bos_id] + ids + [tokenizer.eos_id]
    assert tokenizer.encode_batch(texts, eos=True) == [tokenizer.encode(t, eos=True) for t in texts]


def test_tokenizer_survives_pickling(tokenizer):
    copy = pickle.loads(pickle.dumps(tokenizer))
    text = "a <|begin_of_text|> b"
    assert copy.encode(text) == tokenizer.encode(text)
    assert tokenizer.bos_id not in copy.encode(text)


def test_build_tokenizer_errors_name_path_and_files(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"nope.*tokenizer\.json"):
        build_tokenizer(str(missing))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        build_tokenizer(str(tmp_path))


def test_build_tokenizer_without_config_uses_llama3_names(tmp_path, tokenizer):
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    plain = build_tokenizer(str(tmp_path))
    assert (plain.bos_id, plain.eos_id, plain.pad_id) == (tokenizer.bos_id, tokenizer.eos_id, None)


# --- packing, sharding, resuming ---


def make_loader(tokenizer, path, **overrides):
    kwargs = dict(dataset="local", dataset_path=path, seq_len=8, local_batch_size=1, dp_rank=0, dp_world_size=1)
    return build_dataloader(tokenizer, **{**kwargs, **overrides})


def test_windows_are_the_shifted_document_stream(tokenizer, rng):
    documents = random_documents(rng, 30)
    seq_len = rng.randrange(3, 40)
    stream = [t for doc in documents for t in tokenizer.encode(doc, bos=True, eos=True)]
    samples = list(PackedTokenDataset(documents, tokenizer, seq_len=seq_len, infinite=False))
    assert len(samples) == (len(stream) - 1) // seq_len
    for k, (inputs, labels) in enumerate(samples):
        assert inputs.dtype == labels.dtype == torch.long
        assert inputs.tolist() == stream[k * seq_len : (k + 1) * seq_len]
        assert labels.tolist() == stream[k * seq_len + 1 : (k + 1) * seq_len + 1]


@pytest.mark.parametrize("dp_world_size", [2, 3])
def test_dp_ranks_partition_the_single_process_batches(tokenizer, rng, tmp_path, dp_world_size):
    # Few short documents, so the steps below span several epochs.
    path = write_jsonl(tmp_path / "docs.jsonl", random_documents(rng, 5))
    seq_len, batch, steps = rng.randrange(4, 16), rng.randrange(1, 4), 12
    single = take(make_loader(tokenizer, path, seq_len=seq_len, local_batch_size=batch * dp_world_size), steps)
    for rank in range(dp_world_size):
        loader = make_loader(
            tokenizer,
            path,
            seq_len=seq_len,
            local_batch_size=batch,
            dp_rank=rank,
            dp_world_size=dp_world_size,
        )
        for (inputs, labels), (all_inputs, all_labels) in zip(take(loader, steps), single, strict=True):
            assert inputs.shape == labels.shape == (batch, seq_len)
            assert torch.equal(inputs, all_inputs.view(batch, dp_world_size, seq_len)[:, rank])
            assert torch.equal(labels, all_labels.view(batch, dp_world_size, seq_len)[:, rank])


def test_finite_loader_gives_every_rank_the_same_number_of_batches(tokenizer, rng, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", random_documents(rng, 40))
    counts = set()
    for rank in range(3):
        loader = make_loader(
            tokenizer, path, seq_len=7, local_batch_size=2, dp_rank=rank, dp_world_size=3, infinite=False
        )
        counts.add(len(list(loader)))
        assert len(list(loader)) in counts  # a second pass starts over
    assert len(counts) == 1


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_continues_exactly(tokenizer, rng, tmp_path, num_workers):
    path = write_jsonl(tmp_path / "docs.jsonl", random_documents(rng, 8))
    kwargs = dict(seq_len=rng.randrange(4, 20), local_batch_size=2, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    consumed, following = rng.randrange(1, 15), 6
    expected = take(make_loader(tokenizer, path, **kwargs), consumed + following)[consumed:]

    interrupted = make_loader(tokenizer, path, **kwargs)
    it = iter(interrupted)
    for _ in range(consumed):
        next(it)
    state = pickle.loads(pickle.dumps(interrupted.state_dict()))
    del it

    resumed = make_loader(tokenizer, path, **kwargs)
    resumed.load_state_dict(state)
    for (inputs, labels), (exp_inputs, exp_labels) in zip(take(resumed, following), expected, strict=True):
        assert torch.equal(inputs, exp_inputs) and torch.equal(labels, exp_labels)


def test_pydocs_dataset_and_registry(tokenizer, corpus_cache, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(corpus_cache.parent.parent))
    loader = make_loader(tokenizer, None, dataset="pydocs", seq_len=64, local_batch_size=2, split="validation")
    inputs, labels = next(iter(loader))
    assert inputs[0, 0].item() == tokenizer.bos_id
    assert tokenizer.decode(inputs[0, 1:].tolist()) in load_pydocs_documents("validation")[0]

    register_dataset("test_tiny", lambda split: [f"{split} document"] * 3)
    assert {"pydocs", "test_tiny"} <= set(registered_datasets())
    loader = make_loader(tokenizer, None, dataset="test_tiny", split="dev")
    assert tokenizer.decode(next(iter(loader))[0][0].tolist()).startswith("<|begin_of_text|>dev")
    with pytest.raises(ValueError, match="'nope'.*pydocs"):
        make_loader(tokenizer, None, dataset="nope")


def test_invalid_arguments_are_rejected(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="num_workers=2"):
        make_loader(tokenizer, None, dataset="pydocs", num_workers=2)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedTokenDataset(["x"], tokenizer, seq_len=4, dp_rank=2, dp_world_size=2)
    with pytest.raises(TypeError, match="re-iterable"):
        PackedTokenDataset(iter(["x"]), tokenizer, seq_len=4)
    with pytest.raises(ValueError, match=r"\.csv"):
        make_loader(tokenizer, str(tmp_path / "d.csv"))


def test_txt_file_has_one_document_per_non_empty_line(tokenizer, tmp_path):
    text_file = tmp_path / "d.txt"
    text_file.write_text("first line\n\nsecond line\n", encoding="utf-8")
    loader = make_loader(tokenizer, str(text_file), seq_len=4, infinite=False)
    stream = [t for line in ["first line", "second line"] for t in tokenizer.encode(line, bos=True, eos=True)]
    usable = (len(stream) - 1) // 4 * 4
    assert torch.cat([inputs[0] for inputs, _ in loader]).tolist() == stream[:usable]
