"""Checkpoints at URLs (fsspec): save (sync and async), prune and resume as local paths do; a step without its
completion marker is never loaded."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import run_command, torchrun_command

RUNNER = "tests.integration.remote_trainer"
# The tiny flavor in fp32: checkpoints every 2 steps, the newest 2 kept, no export.
FLAGS = ["--job.config_file", "train_configs/tiny.toml", "--training.mixed_precision_param", "float32",
         "--training.steps", "8", "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2",
         "--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only=false"]


def losses(dump: Path) -> dict[int, float]:
    """Step -> loss; a relaunch's value wins for steps logged twice."""
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def printed_steps(output: str) -> list[list[int]]:
    return [json.loads(m) for m in re.findall(r"^steps: (\[.*\])$", output, re.MULTILINE)]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("local")
    result = run_command([sys.executable, "-m", "torchtitan.train", *FLAGS, f"--job.dump_folder={dump}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(dump)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_url_checkpoints_save_prune_and_resume_with_the_local_losses(tmp_path, local_run, scheme):
    """Per async mode, in one process (memory:// lives as long as it): train 8 steps, make step 8 a save cut short
    (its completion marker gone, its in-progress marker there), relaunch: it resumes from step 6, the newer step
    never counts (it is removed and written again), and steps 7-8 repeat the local run's losses bitwise."""
    args = []
    for mode in ("disabled", "async"):
        url = f"memory://bucket/{mode}" if scheme == "memory" else (tmp_path / "store" / mode).as_uri()
        run = [*FLAGS, "--checkpoint.folder", url, "--checkpoint.async_mode", mode,
               f"--job.dump_folder={tmp_path / mode}"]
        args += [*run, "--then", "steps", url, "--then", "rm", f"{url}/step-8/.complete", "--then",
                 "touch", f"{url}/step-8/.in-progress", "--then", "steps", url, "--then", *run, "--then", "steps", url,
                 "--then"]
    result = run_command([sys.executable, "-m", RUNNER, *args[:-1]])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert printed_steps(output) == [[6, 8], [6], [6, 8]] * 2  # pruned to 2; the unmarked step 8 is not one
    assert output.count("resumed from step 6") == 2
    for mode in ("disabled", "async"):
        assert losses(tmp_path / mode) == local_run
    if scheme == "file":  # what is left: the two complete checkpoints, each with its marker
        for mode in ("disabled", "async"):
            assert sorted(p.name for p in (tmp_path / "store" / mode).iterdir()) == ["step-6", "step-8"]
            assert (tmp_path / "store" / mode / "step-8" / ".complete").is_file()


@pytest.mark.slow
def test_two_ranks_save_async_to_a_shared_object_store_and_resume(tmp_path):
    """FSDP over 2 processes writing to a store without folder renames; a relaunch after step 8's save was cut short
    before its marker (rank 0 removes it while the others wait for its verdict) resumes from step 6 and repeats
    steps 7-8 bitwise."""
    env = {"OBJSTORE_ROOT": str(tmp_path / "store")}
    (tmp_path / "store").mkdir()
    run = [*torchrun_command(2, RUNNER), *FLAGS, "--training.local_batch_size", "2", "--checkpoint.async_mode",
           "async", "--checkpoint.folder", "objstore://bucket/run", f"--job.dump_folder={tmp_path / 'run'}"]
    first = run_command(run, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    straight = losses(tmp_path / "run")
    folder = tmp_path / "store" / "bucket" / "run"
    assert sorted(p.name for p in folder.iterdir()) == ["step-6", "step-8"]
    assert sorted(p.name for p in (folder / "step-8").iterdir()) == [
        ".complete", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    (folder / "step-8" / ".complete").unlink()
    (folder / "step-8" / ".in-progress").write_bytes(b"")  # as a save of ours cut short leaves it
    second = run_command(run, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 6" in second.stdout + second.stderr
    assert losses(tmp_path / "run") == straight
    assert (folder / "step-8" / ".complete").is_file()


def test_an_unreachable_checkpoint_url_is_a_one_line_error_before_training(tmp_path):
    result = run_command([sys.executable, "-m", RUNNER, *FLAGS, "--checkpoint.folder", "unreachable://bucket/run",
                          f"--job.dump_folder={tmp_path}"])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: checkpoint location unreachable://bucket/run is unreachable: ConnectionRefusedError: "
        "[Errno 111] Connection refused"]
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
