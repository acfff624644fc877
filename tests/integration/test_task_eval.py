"""[eval] during training: lm-eval task metrics every N steps, and the training numbers untouched."""

import json

import pytest

from tests.conftest import run_module

pytestmark = pytest.mark.slow


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_task_metrics_every_10_steps_and_the_same_training_losses(tmp_path):
    """Must-show 2: 20 steps with [eval] every 10 log the task metrics at steps 10 and 20; the losses equal those of
    the same run without evaluation bitwise."""
    common = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "20", "--metrics.log_freq", "1"]
    plain = run_module("torchtitan.train", *common, f"--job.dump_folder={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr[-3000:]
    evaluated = run_module("torchtitan.train", *common, "--eval.enable", "--eval.freq", "10", "--eval.limit", "12",
                           f"--job.dump_folder={tmp_path / 'eval'}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    train_rows = [r for r in rows(tmp_path / "eval") if "loss" in r]
    eval_rows = [r for r in rows(tmp_path / "eval") if "eval/pydocs_mc/acc" in r]
    assert [r["step"] for r in eval_rows] == [10, 20]
    assert all(0 <= r["eval/pydocs_mc/acc"] <= 1 and "eval/pydocs_mc/acc_norm" in r for r in eval_rows)
    assert [r["loss"] for r in train_rows] == [r["loss"] for r in rows(tmp_path / "plain")]
    assert [r["grad_norm"] for r in train_rows] == [r["grad_norm"] for r in rows(tmp_path / "plain")]
    assert "eval step: 10  eval/pydocs_mc/acc:" in evaluated.stderr + evaluated.stdout
