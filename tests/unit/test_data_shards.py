"""Pre-tokenized shards: deterministic writing, the same stream as on-the-fly tokenization, resume, bad input."""

import json
import shutil

import numpy as np
import pytest
import torch

from scripts import tokenize_dataset
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.data import DataError, build_dataloader, build_tokenizer
from torchtitan.data.shards import TokenShards

LAYOUT = dict(seq_len=256, local_batch_size=4, dp_rank=0, dp_world_size=1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("assets/tokenizer")


def tokenize(output, *flags):
    assert tokenize_dataset.main(["--dataset", "pydocs", "--split", "validation", "--output", str(output),
                                  "--workers", "1", *flags]) == 0


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards") / "pydocs"
    tokenize(folder, "--shard_tokens", "1000")  # several shards
    return folder


def loader(tokenizer, shards=None, **overrides):
    kwargs = {**LAYOUT, **overrides}
    if shards is None:
        return build_dataloader(tokenizer, dataset="pydocs", dataset_path=None, split="validation", **kwargs)
    return build_dataloader(tokenizer, dataset="x", dataset_path=str(shards), dataset_format="tokens", **kwargs)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_tokenizing_twice_gives_byte_identical_shards(shards, tmp_path):
    again = tmp_path / "again"
    tokenize(again, "--shard_tokens", "1000")
    names = sorted(p.name for p in shards.iterdir())
    assert len([n for n in names if n.endswith(".bin")]) > 2
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (shards / name).read_bytes() == (again / name).read_bytes(), name
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 2048
    assert manifest["num_tokens"] == sum(s["num_tokens"] for s in manifest["shards"])


@pytest.mark.slow
def test_worker_processes_write_the_same_shards(shards, tmp_path):
    parallel = tmp_path / "parallel"
    tokenize(parallel, "--shard_tokens", "1000", "--workers", "2")
    for path in shards.iterdir():
        assert path.read_bytes() == (parallel / path.name).read_bytes(), path.name


def test_the_tokens_source_is_the_text_stream(tokenizer, shards):
    # Past the end of the data (the validation split is small), so the next pass is compared too.
    text, tokens = loader(tokenizer), loader(tokenizer, shards)
    for a, b in zip(take(text, 40), take(tokens, 40), strict=True):
        for field_a, field_b in zip(a, b):
            assert torch.equal(field_a, field_b)
    assert text.state_dict() == tokens.state_dict()
    assert text.state_dict()["stream_position"]["epoch"] >= 1


def test_resume_and_other_layouts_continue_the_same_stream(tokenizer, shards):
    whole = take(loader(tokenizer, shards, local_batch_size=4), 12)
    interrupted = loader(tokenizer, shards, local_batch_size=4)
    it = iter(interrupted)
    for _ in range(5):
        next(it)
    for rank in range(2):
        resumed = loader(tokenizer, shards, local_batch_size=2, dp_rank=rank, dp_world_size=2, num_workers=rank)
        resumed.load_state_dict(interrupted.state_dict())
        for mine, full in zip(take(resumed, 7), whole[5:], strict=True):
            assert torch.equal(mine.input_ids, full.input_ids.view(2, 2, -1)[:, rank])


def test_shuffled_documents_are_a_seeded_permutation_per_pass(tokenizer, shards):
    plain = TokenShards(shards)
    shuffled = TokenShards(shards, shuffle_seed=3)
    first, second = shuffled.order(0), shuffled.order(1)
    assert sorted(first.tolist()) == list(range(len(plain))) and not np.array_equal(first, second)
    assert np.array_equal(first, TokenShards(shards, shuffle_seed=3).order(0))
    assert np.array_equal(next(shuffled.iter_from(0, 1)), plain[int(second[0])])
    stream = take(loader(tokenizer, shards, shuffle_seed=3), 10)
    assert not torch.equal(stream[0].input_ids, take(loader(tokenizer, shards), 1)[0].input_ids)
    interrupted = loader(tokenizer, shards, shuffle_seed=3)
    it = iter(interrupted)
    for _ in range(4):
        next(it)
    resumed = loader(tokenizer, shards, shuffle_seed=3)
    resumed.load_state_dict(interrupted.state_dict())
    for a, b in zip(take(resumed, 6), stream[4:], strict=True):
        assert torch.equal(a.input_ids, b.input_ids)


def copy(shards, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(shards, target)
    return target


def test_bad_shards_give_one_line_errors_naming_the_file(tokenizer, shards, tmp_path):
    broken = copy(shards, tmp_path)
    data = (broken / "tokens-00001.bin").read_bytes()
    (broken / "tokens-00001.bin").write_bytes(data[:-2])
    with pytest.raises(DataError, match=r"tokens-00001.bin: \d+ bytes, but the manifest says \d+ \(truncated"):
        loader(tokenizer, broken)
    (broken / "tokens-00001.bin").unlink()
    with pytest.raises(DataError, match="tokens-00001.bin: missing; the manifest .* lists it"):
        loader(tokenizer, broken)
    other = tmp_path / "other_tokenizer"
    shutil.copytree("assets/tokenizer", other)
    with open(other / "tokenizer.model", "a") as f:
        f.write("\n")  # same ranks, another file: the hash says another tokenizer
    with pytest.raises(DataError, match=r"made with tokenizer tokenizer.model \(sha256 .*\), not the configured "):
        loader(build_tokenizer(str(other)), shards)
    (broken / "manifest.json").write_text("{}")
    with pytest.raises(DataError, match="not a torchtitan-tokens v1 manifest"):
        loader(tokenizer, broken)
    assert (shards / "tokens-00001.bin").exists()  # the original is untouched


def test_ids_beyond_the_shard_dtype_are_refused(tmp_path):
    from torchtitan.data.shards import ShardWriter

    writer = ShardWriter(tmp_path, np.dtype(np.uint16), 1 << 20)
    writer.add(np.array([0, 65535]))
    with pytest.raises(DataError, match="document 1 has token id 70000, beyond uint16"):
        writer.add(np.array([1, 70000]))


def test_config_requires_a_shard_folder(shards):
    def validate(*flags):
        cfg, sources = load_config(["--job.config_file", "train_configs/debug_model.toml", *flags])
        validate_config(cfg, sources, world_size=1)

    validate("--training.dataset_format", "tokens", "--training.dataset_path", str(shards))
    with pytest.raises(ConfigError, match="training.dataset_path = None is required by dataset_format 'tokens'"):
        validate("--training.dataset_format", "tokens")
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        validate("--training.dataset_format", "tokens", "--training.dataset_path", "assets/tokenizer")
