"""Checkpoints: exact resume, crash safety, resharding, and the rules for what is kept."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_command, run_module, trainer_command
from torchtitan.components.checkpointing.checkpoint import complete_steps

# The debug model at seq 256 in fp32: slow enough (~0.3 s/step) to stop a run between checkpoints.
FLAGS = ["--training.mixed_precision_param", "float32", "--training.seq_len", "256", "--training.steps", "16",
         "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "4",
         "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
CONFIG = "train_configs/debug_model.toml"


def launch(dump: Path, nproc: int, extra: list[str], launcher: list[str] | None = None) -> subprocess.Popen:
    """Start a run in its own process group (so it can be killed whole, torchrun and workers alike).

    ``launcher`` replaces the trainer command, e.g. ``["./run_train.sh"]`` (which reads NGPU).
    """
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(nproc), "CONFIG_FILE": CONFIG}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    cmd = [*(launcher or trainer_command(nproc)), "--job.config_file", CONFIG, *FLAGS, *extra,
           f"--job.dump_folder={dump}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_to_end(dump: Path, nproc: int, extra: list[str]) -> str:
    proc = launch(dump, nproc, extra)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return out


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_when(proc: subprocess.Popen, condition, timeout: float = 600) -> None:
    """SIGKILL the run and every process it started, as a crashed node would lose them."""
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
        assert time.time() < deadline, "timed out waiting to kill the run"
        time.sleep(0.02)
    kill_tree(proc)
    time.sleep(0.5)  # let the kernel reap the workers before the relaunch looks at the folder


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it, and reap it."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def losses(dump: Path) -> dict[int, float]:
    """Step -> loss; for steps logged twice (a killed run and its relaunch) the relaunch's value wins."""
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 16-step runs, single process and FSDP 2."""
    runs = {}
    for nproc in (1, 2):
        dump = tmp_path_factory.mktemp(f"straight{nproc}")
        run_to_end(dump, nproc, ["--training.local_batch_size", str(8 // nproc)])
        runs[nproc] = dump
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["single", "fsdp2"])
def test_killed_and_relaunched_run_reproduces_the_straight_run_bitwise(tmp_path, straight, nproc):
    """Async checkpoints and 2 dataloader workers; SIGKILL right after step 8's checkpoint completes."""
    extra = ["--training.local_batch_size", str(8 // nproc), "--checkpoint.async_mode", "async",
             "--training.dataloader.num_workers", "2"]
    proc = launch(tmp_path, nproc, extra)
    kill_when(proc, lambda: 8 in complete_steps(tmp_path / "checkpoint"))
    out = run_to_end(tmp_path, nproc, extra)
    resumed_from = max(s for s in complete_steps(tmp_path / "checkpoint") if s < 16)
    assert "resumed from step" in out
    expected = losses(straight[nproc])
    ours = losses(tmp_path)
    assert [ours[s] for s in range(9, 17)] == [expected[s] for s in range(9, 17)]  # bitwise
    assert resumed_from >= 8


@pytest.mark.slow
def test_kill_during_an_async_save_resumes_from_the_previous_complete_checkpoint(tmp_path, straight):
    extra = ["--training.local_batch_size", "8", "--checkpoint.async_mode", "async"]
    # Checkpoint writes that sleep 3 s first leave a window to kill the run in.
    proc = launch(tmp_path, 1, extra, launcher=[sys.executable, "tests/integration/slow_save_trainer.py"])
    folder = tmp_path / "checkpoint"
    kill_when(proc, lambda: (folder / "step-8.partial").is_dir() and 4 in complete_steps(folder))
    assert complete_steps(folder) == [4]  # the half-written step-8 never counts as a checkpoint
    out = run_to_end(tmp_path, 1, extra)
    assert "resumed from step 4" in out, [l for l in out.splitlines() if "resum" in l or "step-" in l]
    assert not (folder / "step-8.partial").exists()
    expected, ours = losses(straight[1]), losses(tmp_path)
    assert [ours[s] for s in range(5, 17)] == [expected[s] for s in range(5, 17)]


@pytest.mark.slow
def test_resharding_fsdp4_to_fsdp2_tp2_and_to_one_process(tmp_path):
    """Saved at step 4 by 4 FSDP ranks, resumed by FSDP 2 x TP 2 and by one process: steps 5-8 agree."""
    short = ["--training.steps", "8", "--training.seq_len", "64"]
    source = tmp_path / "fsdp4"
    run_to_end(source, 4, [*short, "--training.local_batch_size", "2"])
    fsdp4 = losses(source)
    for name, nproc, extra in [("fsdp2_tp2", 4, ["--training.local_batch_size", "4",
                                                 "--parallelism.tensor_parallel_degree", "2"]),
                               ("single", 1, ["--training.local_batch_size", "8"])]:
        dump = tmp_path / name
        shutil.copytree(source / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
        out = run_to_end(dump, nproc, [*short, *extra])
        assert "resumed from step 4" in out
        ours = losses(dump)
        assert sorted(ours) == [5, 6, 7, 8], name
        for step in ours:
            assert ours[step] == pytest.approx(fsdp4[step], rel=1e-4), (name, step)


def test_finished_run_relaunch_exits_0_and_checkpoint_rules(tmp_path):
    args = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "6", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", f"--job.dump_folder={tmp_path}"]
    first = run_module("torchtitan.train", *args)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "checkpoint"
    assert complete_steps(folder) == [4, 6]  # keep_latest_k = 2
    assert (folder / "export-step-6" / ".metadata").is_file()  # model-only export beside the last checkpoint
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    again = run_module("torchtitan.train", *args)
    assert again.returncode == 0
    assert "resumed from step 6" in again.stdout and "nothing to train" in again.stdout
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == rows  # nothing trained
    # Extending the finished run: train to step 8 from its last checkpoint.
    longer = run_module("torchtitan.train", *args[:3], "8", *args[4:])
    assert longer.returncode == 0, longer.stderr
    assert complete_steps(folder) == [6, 8]


def test_corrupt_checkpoint_gives_a_one_line_error_naming_the_file(tmp_path):
    args = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "2", "--checkpoint.enable",
            f"--job.dump_folder={tmp_path}", "--checkpoint.last_save_model_only=false"]
    assert run_module("torchtitan.train", *args).returncode == 0
    shard = next((tmp_path / "checkpoint" / "step-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    result = run_module("torchtitan.train", *args[:3], "4", *args[4:])
    assert result.returncode == 1
    err = result.stderr.strip().splitlines()
    assert err == [f"error: checkpoint file {shard} is truncated: 100 bytes, the metadata expects at least "
                   f"{err[0].rsplit(' ', 1)[-1]}"], err
    assert int(err[0].rsplit(" ", 1)[-1]) > 100


# Seed checkpoints: the tiny flavor in fp32, one step at global batch 4 under every layout.
SEED_FLAGS = ["--training.mixed_precision_param", "float32", "--training.steps", "1", "--metrics.log_freq", "1",
              "--checkpoint.enable", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
TINY = "train_configs/tiny.toml"


def first_row(dump: Path) -> dict:
    rows = (dump / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1, rows
    return json.loads(rows[0])


def start_from_seed(seed_dump: Path, dump: Path) -> None:
    shutil.copytree(seed_dump / "checkpoint", dump / "checkpoint")


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """(a dump folder holding only a seed checkpoint written with debug.seed 0, the step-1 row of a plain
    seed-0 run, the seed run's output)."""
    seed_dump = tmp_path_factory.mktemp("seed")
    seed = run_module("torchtitan.train", "--job.config_file", TINY, *SEED_FLAGS, "--debug.seed", "0",
                      "--checkpoint.create_seed_checkpoint", f"--job.dump_folder={seed_dump}")
    assert seed.returncode == 0, seed.stderr[-3000:]
    plain = tmp_path_factory.mktemp("plain_seed0")
    result = run_module("torchtitan.train", "--job.config_file", TINY, *SEED_FLAGS, "--debug.seed", "0",
                        f"--job.dump_folder={plain}")
    assert result.returncode == 0, result.stderr[-3000:]
    return seed_dump, first_row(plain), seed.stdout + seed.stderr


def test_seed_checkpoint_holds_the_initial_model_only_and_a_run_starts_from_it(tmp_path, seeded):
    from torch.distributed.checkpoint import FileSystemReader

    seed_dump, reference, seed_output = seeded
    folder = seed_dump / "checkpoint"
    assert complete_steps(folder) == [0] and sorted(p.name for p in folder.iterdir()) == ["step-0"]
    keys = FileSystemReader(str(folder / "step-0")).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys), sorted(keys)[:5]  # the weights, nothing else
    metrics = seed_dump / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # nothing trained
    assert "exiting without training" in seed_output
    # A different debug.seed started from the seed trains exactly the seed-0 numbers; without it, it does not.
    from_seed, unseeded = tmp_path / "from_seed", tmp_path / "seed7"
    start_from_seed(seed_dump, from_seed)
    rows, outputs = {}, {}
    for dump in (from_seed, unseeded):
        result = run_module("torchtitan.train", "--job.config_file", TINY, *SEED_FLAGS, "--debug.seed", "7",
                            f"--job.dump_folder={dump}")
        assert result.returncode == 0, result.stderr[-3000:]
        rows[dump], outputs[dump] = first_row(dump), result.stdout + result.stderr
    assert "resumed from step 0" in outputs[from_seed] and "resumed" not in outputs[unseeded]
    assert rows[from_seed]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert rows[from_seed]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert abs(rows[unseeded]["loss"] - reference["loss"]) > 1e-3 * reference["loss"]
    assert complete_steps(from_seed / "checkpoint") == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--training.local_batch_size", "2"],
                                   ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]],
                         ids=["fsdp2", "tp2"])
def test_seed_checkpoint_starts_parallel_layouts_from_the_same_weights(tmp_path, seeded, flags):
    seed_dump, reference, _ = seeded
    start_from_seed(seed_dump, tmp_path)
    result = run_command([*trainer_command(2), "--job.config_file", TINY, *SEED_FLAGS, "--debug.seed", "7", *flags,
                          f"--job.dump_folder={tmp_path}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from step 0" in result.stdout + result.stderr
    row = first_row(tmp_path)
    assert row["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert row["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
