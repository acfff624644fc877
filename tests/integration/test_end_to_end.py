"""The README's train command, as a user runs it."""

import json
import shutil
import statistics
from pathlib import Path

import pytest

from tests.conftest import run_command, run_module


@pytest.mark.slow
def test_debug_model_learns_through_run_train_sh(tmp_path):
    """Must-show: 150 steps at batch 8 x 256 lower the loss by at least 1.2."""
    result = run_command(
        ["./run_train.sh", "--training.steps", "150", "--training.local_batch_size", "8",
         "--training.seq_len", "256", f"--job.dump_folder={tmp_path}"],
        env={"NGPU": "1"},
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 151))  # the preset logs every step
    drop = rows[0]["loss"] - statistics.mean(r["loss"] for r in rows[-5:])
    assert drop >= 1.2, drop
    assert "step: 150  loss:" in result.stdout
    assert (tmp_path / "config.toml").is_file()


def test_single_process_run_without_torchrun_saves_config_and_appends_metrics(tmp_path):
    args = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "3", f"--job.dump_folder={tmp_path}",
            "--metrics.log_freq", "2"]
    first = run_module("torchtitan.train", *args, "--job.print_config")
    assert first.returncode == 0, first.stderr
    assert '[training]' in first.stdout and 'steps = 3' in first.stdout  # --job.print_config
    assert "steps = 3" in (tmp_path / "config.toml").read_text()
    assert run_module("torchtitan.train", *args).returncode == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 1, 2, 3]  # appended on relaunch, never truncated
    assert all(r["memory_gib"] > 0 and r["tps"] > 0 for r in rows)


@pytest.mark.slow
def test_training_on_pretokenized_shards_gives_the_text_runs_losses(tmp_path):
    """The README flow for shards: tokenize pydocs with the script, train on them: the same losses as on-the-fly."""
    shards = tmp_path / "pydocs_tokens"
    made = run_module("scripts.tokenize_dataset", "--dataset", "pydocs", "--output", str(shards), "--workers", "1")
    assert made.returncode == 0, made.stderr
    common = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "4", "--metrics.log_freq", "1",
              "--training.mixed_precision_param", "float32"]
    losses = {}
    for name, flags in (("text", []), ("tokens", ["--training.dataset_format", "tokens",
                                                  "--training.dataset_path", str(shards)])):
        result = run_module("torchtitan.train", *common, *flags, f"--job.dump_folder={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows]
    assert len(losses["text"]) == 4 and losses["tokens"] == losses["text"]


@pytest.mark.slow
def test_a_mixture_of_text_and_shards_trains_and_logs_each_sources_tokens(tmp_path):
    shards = tmp_path / "pydocs_tokens"
    made = run_module("scripts.tokenize_dataset", "--dataset", "pydocs", "--output", str(shards), "--workers", "1")
    assert made.returncode == 0, made.stderr
    config = tmp_path / "mixture.toml"
    config.write_text(f'extends = "{Path.cwd() / "train_configs/tiny.toml"}"\n'
                      '[[data.sources]]\nname = "text"\ndataset = "pydocs"\nweight = 0.75\n'
                      f'[[data.sources]]\nname = "shards"\nkind = "tokens"\npath = "{shards}"\nweight = 0.25\n'
                      '[[data.stages]]\nstart_step = 3\nweights = [0, 1]\n')
    args = ["--job.config_file", str(config), "--training.steps", "4", "--metrics.log_freq", "1",
            "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only=false",
            f"--job.dump_folder={tmp_path / 'run'}"]
    result = run_module("torchtitan.train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    per_step = 4 * 64  # tiny.toml: 4 sequences of 64 tokens per step
    assert [(r["data/tokens/text"], r["data/tokens/shards"]) for r in rows] == [
        (3 * 64, 64), (6 * 64, 2 * 64), (6 * 64, 2 * 64 + per_step), (6 * 64, 2 * 64 + 2 * per_step)]
    assert all(r["data/epoch/text"] == 0 for r in rows)
    # Resume at the stage boundary (checkpoint step 2; the stage starts at step 3): the same losses and counts.
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-4")
    metrics.unlink()
    resumed = run_module("torchtitan.train", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout + resumed.stderr
    again = [json.loads(line) for line in metrics.read_text().splitlines()]
    keys = ("step", "loss", "data/tokens/text", "data/tokens/shards")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows[2:]]
