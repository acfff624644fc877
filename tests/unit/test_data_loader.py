"""Packing, the one global stream under every layout, workers, and exact resume (also across layouts)."""

import logging
import os
import pickle
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import TOKENIZER
from torchtitan.data import (
    PackedTokenDataset,
    StreamPosition,
    TokenDataLoader,
    build_dataloader,
    build_tokenizer,
    document_ids,
    load_pydocs_documents,
    register_dataset,
)
from torchtitan.log import logger

WORDS = "the of data model loss token rank python é 数据 🙂 def".split() + ["<|end_of_text|>", "\t\n", ""]


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")  # shown by pytest when a test fails
    return random.Random(seed)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(TOKENIZER))


def random_documents(rng, count):
    # Some come out empty or whitespace-only: the loader must skip them.
    return [" ".join(rng.choices(WORDS, k=rng.randrange(0, 30))) for _ in range(count)]


def reference_windows(tokenizer, documents, seq_len, count):
    """Windows 0..count-1 of the packed stream, written out naively (cycling through the documents)."""
    one_pass = [t for doc in documents if doc.strip() for t in tokenizer.encode(doc, bos=True, eos=True)]
    stream = one_pass * ((count + 1) * seq_len // len(one_pass) + 2)
    return [stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(count)]


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def rows(batches):
    """The (input_ids + last label) windows of micro-batches, as lists."""
    return [inputs[i].tolist() + [labels[i, -1].item()] for inputs, labels, *_ in batches for i in range(len(inputs))]


def loader_for(tokenizer, name, **overrides):
    kwargs = dict(dataset=name, dataset_path=None, seq_len=8, local_batch_size=1, dp_rank=0, dp_world_size=1)
    return build_dataloader(tokenizer, **{**kwargs, **overrides})


def test_windows_are_the_packed_document_stream(tokenizer, rng):
    documents = random_documents(rng, 30)
    seq_len = rng.randrange(3, 40)
    samples = list(PackedTokenDataset(documents, tokenizer, seq_len=seq_len, infinite=False))
    one_pass = [t for doc in documents if doc.strip() for t in tokenizer.encode(doc, bos=True, eos=True)]
    assert len(samples) == (len(one_pass) - 1) // seq_len
    expected = reference_windows(tokenizer, documents, seq_len, len(samples))
    for ((inputs, labels, *_), _), window in zip(samples, expected, strict=True):
        assert inputs.dtype == labels.dtype == torch.long and inputs.shape == (1, seq_len)
        assert inputs[0].tolist() == window[:-1] and labels[0].tolist() == window[1:]


def test_document_ids_mark_where_documents_start(tokenizer):
    documents = ["alpha beta", "gamma", "delta epsilon zeta"]
    stream = [t for doc in documents for t in tokenizer.encode(doc, bos=True, eos=True)]
    owner = [i for i, doc in enumerate(documents) for _ in tokenizer.encode(doc, bos=True, eos=True)]
    inputs = torch.tensor([stream[:12], stream[3:15]])
    ids = document_ids(inputs, tokenizer.bos_id)
    for row, start in enumerate((0, 3)):
        expected = [o - owner[start] for o in owner[start : start + 12]]
        assert ids[row].tolist() == expected


# Every layout (dp, local batch, accumulation, workers) of a global batch of 8 sequences.
LAYOUTS = [(1, 8, 1, 0), (1, 2, 4, 2), (2, 4, 1, 0), (2, 1, 4, 2), (4, 2, 1, 0), (4, 1, 2, 2)]


def global_batches(tokenizer, name, dp, local_batch, accumulation, workers, steps, seq_len):
    """The rows each step trains on, over all ranks and micro-batches, in a canonical (sorted) order."""
    per_rank = []
    for rank in range(dp):
        loader = loader_for(tokenizer, name, seq_len=seq_len, local_batch_size=local_batch, dp_rank=rank,
                            dp_world_size=dp, num_workers=workers)
        per_rank.append(take(loader, steps * accumulation))
    return [
        sorted(rows([b for batches in per_rank for b in batches[k * accumulation : (k + 1) * accumulation]]))
        for k in range(steps)
    ]


def test_every_layout_trains_step_k_on_the_same_global_batch(tokenizer, rng):
    # Few short documents, so the steps span several passes over the data.
    documents = random_documents(rng, 6)
    register_dataset("test_layouts", lambda split: documents)
    seq_len, steps, global_batch = rng.randrange(4, 12), 5, 8
    expected = reference_windows(tokenizer, documents, seq_len, steps * global_batch)
    expected = [sorted(expected[k * global_batch : (k + 1) * global_batch]) for k in range(steps)]
    for layout in LAYOUTS:
        assert global_batches(tokenizer, "test_layouts", *layout, steps, seq_len) == expected, layout


def test_dp_ranks_partition_the_single_process_batches_in_order(tokenizer, rng):
    documents = random_documents(rng, 10)
    register_dataset("test_partition", lambda split: documents)
    single = take(loader_for(tokenizer, "test_partition", local_batch_size=6), 7)
    for rank in range(3):
        ours = take(loader_for(tokenizer, "test_partition", local_batch_size=2, dp_rank=rank, dp_world_size=3), 7)
        for (inputs, labels, *_), (all_inputs, all_labels, *_) in zip(ours, single, strict=True):
            assert torch.equal(inputs, all_inputs.view(2, 3, -1)[:, rank])
            assert torch.equal(labels, all_labels.view(2, 3, -1)[:, rank])


@pytest.fixture(scope="module")
def parquet_folder(tmp_path_factory):
    """Two parquet files of short documents (several passes fit in 70 batches), some empty."""
    folder = tmp_path_factory.mktemp("parquet")
    rng = random.Random(0)
    for name in ("part-0.parquet", "part-1.parquet"):
        pq.write_table(pa.table({"text": random_documents(rng, 40)}), folder / name)
    return str(folder)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("source", ["pydocs", "parquet"])
def test_resume_gives_exactly_the_next_50_batches(tokenizer, rng, parquet_folder, source, num_workers):
    kwargs = dict(seq_len=rng.randrange(16, 64), local_batch_size=2, dp_rank=1, dp_world_size=2,
                  num_workers=num_workers)
    if source == "parquet":
        kwargs["dataset_path"] = parquet_folder
    consumed = rng.randrange(1, 20)
    uninterrupted = take(loader_for(tokenizer, "pydocs", **kwargs), consumed + 50)

    interrupted = loader_for(tokenizer, "pydocs", **kwargs)
    it = iter(interrupted)
    for _ in range(consumed):
        next(it)
    state = pickle.loads(pickle.dumps(interrupted.state_dict()))

    resumed = loader_for(tokenizer, "pydocs", **kwargs)
    resumed.load_state_dict(state)
    for (inputs, labels, *_), (expected_inputs, expected_labels, *_) in zip(
        take(resumed, 50), uninterrupted[consumed:], strict=True
    ):
        assert torch.equal(inputs, expected_inputs) and torch.equal(labels, expected_labels)


def test_resume_under_another_dp_degree_neither_repeats_nor_skips(tokenizer, rng):
    documents = random_documents(rng, 12)
    register_dataset("test_relayout", lambda split: documents)
    seq_len, before, after = rng.randrange(4, 16), rng.randrange(1, 6), 6
    reference = reference_windows(tokenizer, documents, seq_len, 8 * (before + after))

    # dp=2, local batch 4: `before` steps of 8 sequences, then each rank saves its state.
    states, trained = [], []
    for rank in range(2):
        loader = loader_for(tokenizer, "test_relayout", seq_len=seq_len, local_batch_size=4, dp_rank=rank,
                            dp_world_size=2)
        trained += rows(take(loader, before))
        states.append(loader.state_dict())
    assert states[0] == states[1]  # any rank's state serves every rank of the next layout
    assert sorted(trained) == sorted(reference[: 8 * before])

    # Resumed as dp=1 (batch 8) and as dp=4 (batch 2, two workers per rank): the stream continues.
    for dp, workers in ((1, 0), (4, 2)):
        resumed = []
        for rank in range(dp):
            loader = loader_for(tokenizer, "test_relayout", seq_len=seq_len, local_batch_size=8 // dp, dp_rank=rank,
                                dp_world_size=dp, num_workers=workers)
            loader.load_state_dict(states[rank % 2])
            resumed += rows(take(loader, after))
        assert sorted(resumed) == sorted(reference[8 * before :]), dp


def test_finite_loader_gives_every_rank_the_same_number_of_batches(tokenizer, rng):
    documents = random_documents(rng, 40)
    register_dataset("test_finite", lambda split: documents)
    counts = set()
    for rank, workers in ((0, 0), (1, 2), (2, 0)):
        loader = loader_for(tokenizer, "test_finite", seq_len=7, local_batch_size=2, dp_rank=rank, dp_world_size=3,
                            infinite=False, num_workers=workers)
        counts.add(len(list(loader)))
        assert len(list(loader)) in counts  # a second pass starts over
    assert len(counts) == 1 and counts.pop() > 0


def test_the_stream_loops_over_the_data_with_a_log_line(tokenizer, caplog):
    register_dataset("test_loop", lambda split: ["one two three", "", "four five"])
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="torchtitan"):
            loader = loader_for(tokenizer, "test_loop", seq_len=5)
            take(loader, 20)
    finally:
        logger.removeHandler(caplog.handler)
    assert "dataset 'test_loop': pass 0 over the data is done; starting pass 1" in caplog.text
    assert loader.state_dict()["stream_position"]["epoch"] >= 2


def test_persistent_workers_restart_at_a_loaded_position(tokenizer, rng):
    documents = random_documents(rng, 20)
    register_dataset("test_persistent", lambda split: documents)
    kwargs = dict(seq_len=6, local_batch_size=2, num_workers=2, persistent_workers=True)
    expected = take(loader_for(tokenizer, "test_persistent", **kwargs), 12)
    loader = loader_for(tokenizer, "test_persistent", **kwargs)
    take(loader, 5)
    state = loader.state_dict()
    take(loader, 3)  # the persistent workers are now past the saved position
    loader.load_state_dict(state)
    assert rows(take(loader, 7)) == rows(expected[5:])


def test_bad_states_and_arguments_are_rejected(tokenizer):
    loader = loader_for(tokenizer, "pydocs")
    assert loader.state_dict() == {"stream_position": {"epoch": 0, "document": 0, "offset": 0}, "counts": {}}
    with pytest.raises(ValueError, match="expected 'stream_position'"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="invalid stream position.*document"):
        loader.load_state_dict({"stream_position": {"epoch": 0, "document": -1, "offset": 0}})
    assert StreamPosition.from_state_dict(StreamPosition(1, 2, 3).state_dict()) == StreamPosition(1, 2, 3)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedTokenDataset(["x"], tokenizer, seq_len=4, dp_rank=2, dp_world_size=2)
    with pytest.raises(ValueError, match="local_batch_size must be >= 1, got 0"):
        PackedTokenDataset(["x"], tokenizer, seq_len=4, local_batch_size=0)
    with pytest.raises(TypeError, match="re-iterable"):
        PackedTokenDataset(iter(["x"]), tokenizer, seq_len=4)
    assert isinstance(loader, TokenDataLoader)


def test_pydocs_is_the_default_and_has_a_validation_split(tokenizer):
    loader = loader_for(tokenizer, "pydocs", seq_len=64, local_batch_size=2, split="validation")
    inputs, *_ = next(iter(loader))
    assert inputs[0, 0].item() == tokenizer.bos_id
    assert tokenizer.decode(inputs[0, 1:].tolist()) in load_pydocs_documents("validation")[0]
