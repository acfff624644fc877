"""Shared by the parity tests: run the trainer under a layout and compare its metrics with a reference run."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_command, run_module

# The debug model at a short sequence keeps these multi-process runs to seconds per step.
COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "256", "--training.steps", "6",
          "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
CONFIG = "train_configs/debug_model.toml"


def read_rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_matches(rows, reference):
    """The 6 steps of the debug-model reference run: losses and grad norms within 1e-4 relative."""
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert_same_steps(rows, reference)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it trains, so the comparison is not between constants


def train(dump: Path, nproc: int, flags: list[str], config: str = CONFIG, common=COMMON) -> list[dict]:
    result = run_command(["./run_train.sh", *common, *flags, f"--job.dump_folder={dump}"],
                         env={"NGPU": str(nproc), "CONFIG_FILE": config})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_rows(dump)


def assert_same_steps(rows: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    for ours, ref in zip(rows, expected):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ours["step"]


def assert_tiny_matches_single_process(tmp_path: Path, nproc: int, flags: list[str]) -> None:
    """4 steps of the tiny flavor (fp32, global batch 8) on ``nproc`` processes against one process."""
    common = ["--training.mixed_precision_param", "float32", "--training.steps", "4", "--metrics.log_freq", "1",
              "--comm.init_timeout_seconds", "900", "--comm.train_timeout_seconds", "900"]
    config = "train_configs/tiny.toml"
    single = tmp_path / "single"
    result = run_module("torchtitan.train", "--job.config_file", config, *common, "--training.local_batch_size", "8",
                        f"--job.dump_folder={single}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train(tmp_path / "parallel", nproc, flags, config=config, common=common)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_same_steps(rows, read_rows(single))


def assert_resumes_under_another_layout(tmp_path: Path, source: tuple[int, list[str]],
                                        target: tuple[int, list[str]]) -> None:
    """Saved at step 3 under ``source`` (nproc, flags), resumed under ``target``: steps 4-6 match the
    uninterrupted source run."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--training.local_batch_size", "8"]
    straight = train(tmp_path / "straight", source[0], [*ckpt, *source[1]])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    result = run_command(["./run_train.sh", *COMMON, *ckpt, *target[1], f"--job.dump_folder={resumed}"],
                         env={"NGPU": str(target[0]), "CONFIG_FILE": CONFIG})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from step 3" in result.stdout + result.stderr
    assert_same_steps(read_rows(resumed), straight[3:])
