"""The hang watchdog in a real 2-process gloo job whose rank 1 hangs on purpose at step 3 (tests/hang_on_purpose.py):
each rank's stack file names where it is (the sleeping line, the collective), and with hang_exit the job ends by
itself soon after the timeout."""

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import hang_on_purpose
from tests.conftest import REPO, torchrun_command
from tests.integration.test_checkpoint import kill_tree
from torchtitan.components.observability.hang_watchdog import HANG_EXIT_CODE, HangWatchdog

TIMEOUT = 5
TIMEOUT_IN_PROCESS = 3
FLAGS = ["--job.config_file", "train_configs/tiny.toml", "--training.steps", "10",
         "--observability.hang_timeout_seconds", str(TIMEOUT), "--comm.train_timeout_seconds", "60",
         "--experimental.custom_import", "tests.hang_on_purpose"]


def launch(dump: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, "HANG_STAMP": str(dump / "hang_started")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return subprocess.Popen([*torchrun_command(2, "torchtitan.train", ranks=None), *FLAGS, *extra,
                             f"--job.dump_folder={dump}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def training_thread(stacks: Path) -> str:
    """The training thread's stack in a rank's file (the first thread listed)."""
    text = stacks.read_text()
    assert text.count("=== hang watchdog") == 1, text
    return text.split("\n--- ")[1]


def assert_positions(dump: Path, out: str) -> None:
    sleeping = f"tests/hang_on_purpose.py:{_line_of('THE HANG')} in sleep_forever_on_purpose"
    hung = training_thread(dump / "hangs" / "rank1.txt")
    assert hung.startswith("training thread MainThread")
    assert hung.rstrip().endswith("time.sleep(3600)  # THE HANG") and "in sleep_forever_on_purpose" in hung, hung
    assert re.search(rf"rank 1 made no progress for [\d.]+ s \(timeout {TIMEOUT} s\) after step 2, in phase data; the training "
                     rf"thread is at {re.escape(sleeping)};", out), out[-5000:]
    # Rank 0 went on into step 3 and waits for rank 1 in the step's first collective (the all-reduce of the
    # step's token count, which completes on first use).
    waiting = training_thread(dump / "hangs" / "rank0.txt")
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', waiting)
    innermost_collective = [f for f in frames if "/torch/distributed/" in f[0]][-1]
    assert innermost_collective[2] == "wait_tensor", frames[-4:]
    assert any(f[0].endswith("torchtitan/train.py") and f[2] == "train_step" for f in frames)
    line = re.search(r"rank 0 made no progress for [\d.]+ s \(timeout \d+ s\) after step 2, in phase forward_backward; the "
                     r"training thread is "
                     r"at (.*?); every", out)
    assert line, out[-5000:]
    assert re.fullmatch(r"torch/distributed/_functional_collectives\.py:\d+ in wait_tensor, called from "
                        r"torchtitan/train\.py:\d+ in train_step", line.group(1)), line.group(1)


def _line_of(marker: str) -> int:
    source = Path(hang_on_purpose.__file__).read_text().splitlines()
    return next(i for i, text in enumerate(source, start=1) if marker in text)


@pytest.mark.slow
def test_a_hung_rank_and_its_waiting_peer_are_named_and_hang_exit_ends_the_job(tmp_path):
    proc = launch(tmp_path, "--observability.hang_exit")
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    ended = time.time()
    hang_started = float((tmp_path / "hang_started").read_text())
    assert proc.returncode != 0, out[-5000:]
    assert f"exitcode  : {HANG_EXIT_CODE}" in out  # torchrun's report: the watchdog ended the ranks
    print(f"the job ended {ended - hang_started:.1f} s after the hang began (timeout {TIMEOUT} s)")
    assert ended - hang_started <= TIMEOUT + 10, (ended - hang_started, out[-5000:])
    assert_positions(tmp_path, out)
    assert out.count(f"ending the process (exit code {HANG_EXIT_CODE})") == 2


@pytest.mark.slow
def test_without_hang_exit_the_stacks_are_written_and_the_job_is_left_running(tmp_path):
    proc = launch(tmp_path)
    try:
        deadline = time.time() + 240
        files = [tmp_path / "hangs" / f"rank{rank}.txt" for rank in (0, 1)]
        while not all(f.exists() for f in files):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-5000:]
            time.sleep(0.1)
        time.sleep(3)  # the logs' last lines, and time enough to have ended had it been asked to
        assert proc.poll() is None  # still hanging: ending it is left to the collective timeout (60 s here)
    finally:
        kill_tree(proc)
    out = proc.stdout.read()
    assert_positions(tmp_path, out)
    assert "ending the process" not in out


def slow_first_validation_and_save(trainer, seconds: float) -> list[str]:
    """Make the trainer's first validation and first checkpoint save each sleep ``seconds`` first; returns the list
    they append their names to as they do."""
    slowed = []

    def slow_first_call(name, call):
        def slow(*args, **kwargs):
            if name not in slowed:
                slowed.append(name)
                time.sleep(seconds)
            return call(*args, **kwargs)
        return slow

    trainer.validator.validate = slow_first_call("validation", trainer.validator.validate)
    trainer.checkpointer.save = slow_first_call("save", trainer.checkpointer.save)
    return slowed


@pytest.mark.slow  # a trainer in process, waiting past the timeout on purpose
def test_the_trainer_feeds_the_watchdog_each_step_and_pauses_it_for_validation_and_saves(tmp_path, monkeypatch):
    """In process: a validation and a checkpoint save each take longer than the hang timeout (slowed on purpose)
    and fire nothing; the watchdog got every step's end and duration, and stops when training returns."""
    from tests.integration.test_training import make_trainer
    from torchtitan.components.observability import observer

    # Looking often, so a pause only a little longer than the timeout would be caught were it not paused; the
    # timeout leaves a busy machine's ordinary steps (up to ~1.5 s seen) well inside it.
    monkeypatch.setattr(observer, "HangWatchdog", functools.partial(HangWatchdog, poll_seconds=0.05))
    trainer = make_trainer(tmp_path, "--training.steps", "3", "--validation.enable", "--validation.freq", "2",
                           "--validation.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--observability.hang_timeout_seconds", str(TIMEOUT_IN_PROCESS))
    slowed = slow_first_validation_and_save(trainer, TIMEOUT_IN_PROCESS + 0.5)
    watchdog = trainer.observer.watchdog
    try:
        trainer.train()
        assert watchdog._thread is None  # stopped as train() returned
    finally:
        trainer.close()
    assert slowed == ["validation", "save"]
    assert watchdog.fired == 0 and not (tmp_path / "hangs").exists()
    assert watchdog._step == 3 and watchdog._steps == 3
    durations = list(watchdog._durations)  # steps 2 and 3 (the first warms up), each the data wait and the step
    assert len(durations) == 2 and all(0 < d < 60 for d in durations), durations


@pytest.mark.slow  # a trainer in process, waiting past the timeout on purpose
def test_the_trainers_pauses_are_watched_with_a_long_timeout_and_only_reported_even_with_hang_exit(tmp_path,
                                                                                                  monkeypatch):
    """In process: comm.train_timeout_seconds = 8 makes the pauses' timeout min(0.8x 8, 8 - 6) = 2 s; a validation
    and a checkpoint save slowed past it are each reported once (stacks and a line saying why the process is not
    ended), and with hang_exit nothing ends the process; training goes on to its last step."""
    from tests.integration.test_training import make_trainer
    from torchtitan.components.observability import hang_watchdog, observer

    exits, lines = [], []
    monkeypatch.setattr(hang_watchdog.os, "_exit", exits.append)
    monkeypatch.setattr(hang_watchdog.logger, "warning", lambda line: lines.append(line))
    monkeypatch.setattr(observer, "HangWatchdog", functools.partial(HangWatchdog, poll_seconds=0.05))
    trainer = make_trainer(tmp_path, "--training.steps", "3", "--validation.enable", "--validation.freq", "2",
                           "--validation.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--comm.train_timeout_seconds", "8", "--observability.hang_exit")
    slowed = slow_first_validation_and_save(trainer, 3)
    watchdog = trainer.observer.watchdog
    try:
        trainer.train()
    finally:
        trainer.close()
    assert slowed == ["validation", "save"] and trainer.step == 3
    hangs = [line for line in lines if line.startswith("hang: ")]
    assert exits == [] and watchdog.fired == len(hangs) >= 2, lines
    # Step 2's validation runs in its evaluation phase, its save in its checkpoint phase; step 2 is not finished.
    for phase in ("evaluation", "checkpoint"):
        assert any(f"(timeout 2 s) after step 1, in phase {phase}, during " in line for line in hangs), hangs
    for line in hangs:
        assert line.endswith("the collective timeout (comm.train_timeout_seconds = 8 s) ends a real hang"), line
        assert "only reported, the process is not ended" in line and "ending the process" not in line
    assert (tmp_path / "hangs" / "rank0.txt").read_text().count("=== hang watchdog") == len(hangs)
