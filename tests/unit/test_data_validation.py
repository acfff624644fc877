"""Validation (loss and perplexity on held-out data), the data config checks, and bad data in a real run."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import TOKENIZER, run_module
from torchtitan.components.evaluation.validate import Validator
from torchtitan.components.objectives.loss import build_cross_entropy_loss
from torchtitan.config import ConfigError, load_config
from torchtitan.config.job_config import Validation
from torchtitan.config_check import validate_config
from torchtitan.data import DataError, build_tokenizer


class TinyLM(nn.Module):
    def __init__(self, vocab=2048, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.modes = []

    def forward(self, tokens):
        self.modes.append(self.training)
        return self.out(self.embed(tokens))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(TOKENIZER))


@pytest.fixture
def held_out(tmp_path):
    path = tmp_path / "val.jsonl"
    docs = [f"held out document {i} " + "word " * (i % 7) for i in range(40)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path), docs


def make_validator(tokenizer, path, dp_rank=0, dp_world_size=1, **overrides):
    cfg = Validation(**{"enable": True, "dataset_path": path, "local_batch_size": 2, "seq_len": 8, "freq": 5,
                        **overrides})
    return Validator(cfg, tokenizer, dp_rank=dp_rank, dp_world_size=dp_world_size,
                     loss_fn=build_cross_entropy_loss(), device=torch.device("cpu"))


def test_validation_loss_is_the_token_mean_over_the_held_out_windows(tokenizer, held_out):
    path, docs = held_out
    model = TinyLM()
    result = make_validator(tokenizer, path).validate([model], step=5)

    stream = [t for d in docs for t in tokenizer.encode(d, bos=True, eos=True)]
    windows = (len(stream) - 1) // 8 // 2 * 2  # whole micro-batches of 2 windows only
    tokens = torch.tensor([stream[i * 8 : i * 8 + 9] for i in range(windows)])
    with torch.no_grad():
        expected = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert result["val_tokens"] == windows * 8
    assert result["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["val_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert model.training and not any(model.modes[: windows // 2])  # eval during validation, train after


def test_data_parallel_shares_combine_to_the_single_process_loss(tokenizer, held_out):
    path, _ = held_out
    model = TinyLM()
    single = make_validator(tokenizer, path, local_batch_size=4).validate([model], step=5)
    shares = [make_validator(tokenizer, path, r, 2).validate([model], step=5) for r in range(2)]
    assert sum(s["val_tokens"] for s in shares) == single["val_tokens"]
    combined = sum(s["val_loss"] * s["val_tokens"] for s in shares) / single["val_tokens"]
    assert combined == pytest.approx(single["val_loss"], rel=1e-5)


def test_steps_frequency_and_repeatability(tokenizer, held_out):
    path, _ = held_out
    validator = make_validator(tokenizer, path, steps=3)
    first = validator.validate([TinyLM()], step=5)
    assert first["val_tokens"] == 3 * 2 * 8
    assert validator.validate([TinyLM()], step=10) == first  # the same batches every time
    assert [s for s in range(1, 21) if validator.should_validate(s)] == [5, 10, 15, 20]
    assert not make_validator(tokenizer, path, enable=False).should_validate(5)
    with pytest.raises(DataError, match="fewer tokens than one validation batch"):
        make_validator(tokenizer, path, seq_len=4096).validate([TinyLM()], step=5)


def config_error(*flags):
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", *flags])
    try:
        validate_config(cfg, sources, world_size=1)
    except ConfigError as e:
        return str(e)
    return None


def test_data_config_checks():
    assert config_error("--training.dataloader.num_workers", "2", "--validation.enable") is None
    assert config_error("--validation.enable", "--validation.dataset", "c4_validation") is None
    assert "validation.seq_len = 128 is longer than training.seq_len = 64" in config_error(
        "--validation.enable", "--validation.seq_len", "128")
    assert "validation.dataset = 'fineweb-edu' has no validation split" in config_error(
        "--validation.enable", "--validation.dataset", "fineweb-edu")
    assert "validation.steps = 0 is invalid" in config_error("--validation.enable", "--validation.steps", "0")
    assert "validation.dataset_path = '/no/such' does not exist" in config_error(
        "--validation.enable", "--validation.dataset_path", "/no/such")
    assert "training.dataloader.num_workers = -1 is invalid" in config_error(
        "--training.dataloader.num_workers=-1")
    assert "training.dataloader.prefetch_factor = 2 is invalid" in config_error(
        "--training.dataloader.prefetch_factor", "2")
    assert "persistent_workers = True needs training.dataloader.num_workers > 0" in config_error(
        "--training.dataloader.persistent_workers")


@pytest.mark.slow
def test_a_bad_row_mid_training_exits_2_with_one_line(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [json.dumps({"text": f"training document {i} with a few words"}) for i in range(400)]
    data.write_text("\n".join(rows[:300] + ['{"text": 42}'] + rows[300:]) + "\n")
    result = run_module("torchtitan.train", "--job.config_file", "train_configs/tiny.toml",
                        "--training.dataset_path", str(data), "--training.dataloader.num_workers", "2",
                        "--training.steps", "40", "--metrics.log_freq", "1", f"--job.dump_folder={tmp_path / 'out'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {data}: row 300: column 'text' holds int 42, not text"]
    assert "Traceback" not in result.stdout + result.stderr
    steps = [json.loads(line)["step"] for line in Path(tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(steps) < 40  # it failed in the middle of training
