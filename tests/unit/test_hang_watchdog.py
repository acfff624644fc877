"""The hang watchdog: when it arms and how long it waits, what it writes when it fires (once per hang), and that
paused work and the start are watched only with a long timeout that never ends the process."""

import functools
import inspect
import logging
import os
import pickle
import threading
import time

import pytest
import torch

from torchtitan.components.observability import hang_watchdog
from torchtitan.components.observability.hang_watchdog import (
    HANG_EXIT_CODE,
    PAUSED_WORK,
    HangWatchdog,
    auto_timeout,
    config_problems,
)
from torchtitan.components.observability.observer import RunObserver
from torchtitan.config.job_config import Comm, Observability


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def close_every_watchdog(monkeypatch):
    """A test that fails before its close() must not leave a watching thread behind for the next tests."""
    made = []
    init = HangWatchdog.__init__

    def recording_init(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(HangWatchdog, "__init__", recording_init)
    yield
    for w in made:
        w.close()


@pytest.fixture
def log_lines():
    """The warning lines the torchtitan logger emits during the test (it does not propagate to pytest's)."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    hang_watchdog.logger.addHandler(handler)
    yield lines
    hang_watchdog.logger.removeHandler(handler)


def watchdog(tmp_path, clock, timeout=0.0, train_timeout=100.0, poll=3600.0, init_timeout=300.0, **cfg):
    # A long poll: the tests call check() themselves, the thread never looks.
    return HangWatchdog(Observability(hang_timeout_seconds=timeout, **cfg), train_timeout, init_timeout,
                        str(tmp_path), 0, torch.device("cpu"), clock=clock, poll_seconds=poll, exit_grace_seconds=0)


@pytest.mark.parametrize("median,train_timeout,expected", [
    (0.5, 100, 30.0),  # 5 s: raised to the 30 s floor
    (2.0, 100, 30.0),
    (4.0, 100, 40.0),  # 10x the median
    (6.5, 1000, 65.0),
    (9.0, 100, 80.0),  # 90 s: capped at 0.8x the collective timeout
    (50.0, 200, 160.0),
    (1.0, 40, 30.0),  # the floor below the cap
    (1.0, 20, 14.0),  # the cap wins over the floor: the stacks must come before the collective timeout, with 6 s
    (0.1, 30, 24.0),  # for the thread's poll and the NCCL dump (here 0.8x leaves exactly that)
    (2.0, 10, 4.0),
])
def test_the_automatic_timeout_is_ten_median_steps_within_30_s_and_the_collective_timeouts_cap(median,
                                                                                             train_timeout, expected):
    steps = [median * 0.5, median, median * 3]  # the median is taken, not the mean
    assert auto_timeout(steps, train_timeout) == pytest.approx(expected)


def test_arming_explicit_after_the_first_step_auto_after_three_without_the_first(tmp_path):
    clock = FakeClock()
    explicit = watchdog(tmp_path, clock, timeout=7.0)
    assert explicit.timeout() == 240.0  # the first step compiles: only the start's 0.8x comm.init_timeout_seconds
    explicit.progress(step=1, step_seconds=500.0)
    assert explicit.timeout() == 7.0
    explicit.close()

    auto = watchdog(tmp_path, clock, train_timeout=1000.0)
    assert auto.timeout() == 240.0
    for step, seconds in ((1, 900.0), (2, 4.0)):
        auto.progress(step=step, step_seconds=seconds)
        assert auto.timeout() is None
    auto.progress(phase="data")  # a phase boundary is progress, not a finished step
    assert auto.timeout() is None
    auto.progress(step=3, step_seconds=6.0)
    assert auto.timeout() == pytest.approx(50.0)  # median(4, 6) x 10; with step 1's 900 s it would be 60 s
    auto.progress(step=4, step_seconds=8.0)
    assert auto.timeout() == pytest.approx(60.0)
    auto.close()


def test_it_fires_once_per_hang_and_rearms_after_progress(tmp_path, log_lines):
    clock = FakeClock()
    w = watchdog(tmp_path, clock, timeout=10.0)
    clock.now += 100
    assert not w.check()  # before the first step only the start's long timeout (240 s here) applies
    w.progress(step=5, step_seconds=1.0)
    w.progress(phase="forward_backward")
    clock.now += 9.9
    assert not w.check()
    clock.now += 0.2
    assert w.check()
    clock.now += 50
    assert not w.check()  # the same hang: reported once
    stacks = (tmp_path / "hangs" / "rank0.txt").read_text()
    assert stacks.count("=== hang watchdog") == 1
    assert "no progress for 10.1 s (timeout 10 s) after step 5, in phase forward_backward" in stacks
    assert len(log_lines) == 1 and "rank 0 made no progress for 10.1 s (timeout 10 s) after step 5, in phase " \
                                   "forward_backward" in log_lines[0]
    w.progress(step=6, step_seconds=1.0)  # it moved on: a later hang is a new one
    clock.now += 12
    assert w.check()
    assert not w.check()
    assert w.fired == 2 and len(log_lines) == 2
    stacks = (tmp_path / "hangs" / "rank0.txt").read_text()
    assert stacks.count("=== hang watchdog") == 2  # appended: the first hang's stacks are kept
    assert "no progress for 12.0 s (timeout 10 s) after step 6\n" in stacks  # a step's end leaves no phase
    w.close()


def test_paused_work_shorter_than_its_long_timeout_never_fires_and_its_time_does_not_count(tmp_path):
    clock = FakeClock()
    w = watchdog(tmp_path, clock, timeout=10.0, poll=0.005)  # the real thread looks, on the fake clock
    w.progress(step=1, step_seconds=1.0)
    clock.now += 5
    with w.paused():  # entering restarts the clock: 79 s inside, not 5 + 79
        clock.now += 79  # a long checkpoint save, below 0.8x comm.train_timeout_seconds = 80 s
        with w.paused():  # nested: validation inside a save's pause, say
            clock.now += 79.9
        clock.now += 79
        time.sleep(0.1)  # many polls
        assert w.fired == 0
    clock.now += 9  # the pause restarted the clock: 9 s, not 5 + 9
    time.sleep(0.1)
    assert w.fired == 0 and not (tmp_path / "hangs").exists()
    clock.now += 2
    deadline = time.monotonic() + 10
    while w.fired == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.fired == 1
    w.close()


REPORT_ONLY = "; only reported, the process is not ended: {work} may legitimately take long, and the collective " \
              "timeout ({field} = {seconds} s) ends a real hang"


@pytest.fixture
def exits(monkeypatch):
    """The codes os._exit was called with (it is not: a test must not end pytest)."""
    codes = []
    monkeypatch.setattr(hang_watchdog.os, "_exit", codes.append)
    return codes


@pytest.mark.parametrize("train_timeout,expected", [(100.0, 80.0), (200.0, 160.0), (20.0, 14.0)])
def test_a_hang_inside_paused_work_is_only_reported_after_0_8_collective_timeouts(tmp_path, log_lines, exits,
                                                                                train_timeout, expected):
    """Even with hang_exit and a short explicit timeout: a checkpoint save may be long, the collective timeout
    (comm.train_timeout_seconds, which its collectives run under) ends a real hang. Leaving the pause brings the
    normal rules back. 0.8x the collective timeout, 6 s below it at most (the poll and the NCCL dump)."""
    clock = FakeClock()
    w = watchdog(tmp_path, clock, timeout=5.0, train_timeout=train_timeout, hang_exit=True)
    w.progress(step=1, step_seconds=1.0)
    w.progress(phase="checkpoint")
    with w.paused("a checkpoint save"):
        assert w.timeout() == expected
        clock.now += expected - 0.1
        assert not w.check()
        clock.now += 0.2
        assert w.check()
        clock.now += 1000
        assert not w.check()  # once per hang
    assert exits == [] and len(log_lines) == 1
    assert f"made no progress for {expected + 0.1:.1f} s (timeout {expected:g} s) after step 1, in phase checkpoint, " \
           "during a checkpoint save; the training thread is at " in log_lines[0], log_lines[0]
    assert log_lines[0].endswith(REPORT_ONLY.format(work="a checkpoint save", field="comm.train_timeout_seconds",
                                                    seconds=f"{train_timeout:g}")), log_lines[0]
    stacks = (tmp_path / "hangs" / "rank0.txt").read_text()
    assert f"(timeout {expected:g} s) after step 1, in phase checkpoint, during a checkpoint save\n" in stacks
    # Out of the pause: the explicit 5 s again, and with hang_exit the process is ended.
    clock.now += 5.1
    assert w.check()
    assert exits == [HANG_EXIT_CODE] and log_lines[1].endswith(f"ending the process (exit code {HANG_EXIT_CODE})")
    w.close()


@pytest.mark.parametrize("init_timeout,expected", [(300.0, 240.0), (50.0, 40.0)])
def test_before_the_first_step_a_hang_is_only_reported_after_0_8_init_timeouts(tmp_path, log_lines, exits,
                                                                             init_timeout, expected):
    """Loading a checkpoint and the first step's compilation and NCCL setup (under comm.init_timeout_seconds):
    reported, never ended, even with hang_exit; paused work before the first step too. Then the normal rules."""
    clock = FakeClock()
    w = watchdog(tmp_path, clock, timeout=5.0, init_timeout=init_timeout, hang_exit=True)
    assert w.timeout() == expected
    clock.now += expected - 0.1
    assert not w.check()
    clock.now += 0.2
    assert w.check()
    w.progress(phase="data")  # the first step begins: a new hang may be reported
    clock.now += expected + 0.5
    assert w.check()
    with w.paused("validation"):  # e.g. validating a loaded checkpoint before training
        clock.now += expected + 0.5
        assert w.check()
    assert exits == [] and len(log_lines) == 3
    situations = ["before this process's first step finished;", "before this process's first step finished, in "
                  "phase data;", "before this process's first step finished, in phase data, during validation;"]
    works = [hang_watchdog._START, hang_watchdog._START, "validation"]
    for line, situation, work in zip(log_lines, situations, works):
        assert f"(timeout {expected:g} s) {situation} the training thread is at " in line, line
        assert line.endswith(REPORT_ONLY.format(work=work, field="comm.init_timeout_seconds",
                                                seconds=f"{init_timeout:g}")), line
    w.progress(step=1, step_seconds=30.0)  # the first step finished: the explicit 5 s, which ends the process
    clock.now += 5.1
    assert w.check()
    assert exits == [HANG_EXIT_CODE]
    w.close()


def test_a_collective_timeout_too_short_for_stacks_leaves_that_situation_unwatched(tmp_path):
    clock = FakeClock()
    w = watchdog(tmp_path, clock, timeout=5.0, init_timeout=6.0, train_timeout=100.0)
    assert w.timeout() is None  # 0.8x 6 s would be past 6 s less the poll and the NCCL dump
    clock.now += 1000
    assert not w.check()
    w.close()
    w = watchdog(tmp_path, clock, timeout=5.0, init_timeout=7.0)
    assert w.timeout() == 1.0
    w.close()


def test_the_observer_builds_the_watchdog_from_comm_and_passes_the_pauses_label(tmp_path, monkeypatch, log_lines):
    from torchtitan.components.observability import observer

    clock = FakeClock()
    monkeypatch.setattr(observer, "HangWatchdog", functools.partial(HangWatchdog, clock=clock, poll_seconds=3600))
    run = RunObserver(Observability(record_phases=False), str(tmp_path), 0, torch.device("cpu"), 1, None,
                      Comm(init_timeout_seconds=150, train_timeout_seconds=50))
    assert run.watchdog.timeout() == 120.0
    run.begin_step(1)
    run.mark("data")
    run.end_step(1)
    for label, expected in (("task evaluation", "task evaluation"), (None, PAUSED_WORK)):
        with run.paused(label) if label else run.paused():
            assert run.watchdog.timeout() == 40.0
            clock.now += 40.5
            assert run.watchdog.check()
    run.close()
    assert len(log_lines) == 2
    assert "(timeout 40 s) after step 1, during task evaluation; the training thread" in log_lines[0], log_lines[0]
    assert f"(timeout 40 s) after step 1, during {PAUSED_WORK}; the training thread" in log_lines[1], log_lines[1]
    assert log_lines[1].endswith("(comm.train_timeout_seconds = 50 s) ends a real hang")


def wait_on_event_on_purpose(stop: threading.Event, watchdog_made: list, tmp_path) -> None:
    watchdog_made.append(HangWatchdog(Observability(hang_timeout_seconds=0.2), 100.0, 300.0, str(tmp_path), 3,
                                      torch.device("cpu"), poll_seconds=0.02))
    watchdog_made[0].progress(step=2, step_seconds=0.01)
    stop.wait()  # BLOCKED HERE


def hold_a_lock_on_purpose(stop: threading.Event, watchdog_made: list, tmp_path) -> None:
    lock = threading.Lock()
    lock.acquire()
    watchdog_made.append(HangWatchdog(Observability(hang_timeout_seconds=0.2), 100.0, 300.0, str(tmp_path), 3,
                                      torch.device("cpu"), poll_seconds=0.02))
    watchdog_made[0].progress(step=2, step_seconds=0.01)
    while not stop.is_set():
        lock.acquire(timeout=0.05)  # BLOCKED HERE


@pytest.mark.parametrize("blocked", [wait_on_event_on_purpose, hold_a_lock_on_purpose])
def test_a_real_hang_writes_every_stack_naming_the_blocked_line_first(tmp_path, log_lines, blocked):
    """The watchdog's thread, on the real clock: the thread that built it (the trainer's) blocks in ``blocked``;
    a bystander thread waits elsewhere. The file names the blocked line first, the bystander after."""
    stop, made = threading.Event(), []
    source, first = inspect.getsourcelines(blocked)
    line = first + next(i for i, text in enumerate(source) if "BLOCKED HERE" in text)
    bystander = threading.Thread(target=stop.wait, name="bystander", daemon=True)
    bystander.start()
    trainer = threading.Thread(target=blocked, args=(stop, made, tmp_path), name="trainer", daemon=True)
    trainer.start()
    path = tmp_path / "hangs" / "rank3.txt"
    deadline = time.monotonic() + 20
    while not log_lines and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # 25 more polls: still one report
    stop.set()
    trainer.join()
    bystander.join()
    own = made[0]._thread.ident
    made[0].close()
    text = path.read_text()
    assert text.count("=== hang watchdog") == 1 and made[0].fired == 1
    where = f"tests/unit/test_hang_watchdog.py:{line} in {blocked.__name__}"
    sections = text.split("\n--- ")
    assert sections[1].startswith("training thread trainer")
    assert f'test_hang_watchdog.py", line {line}, in {blocked.__name__}' in sections[1]
    assert any(s.startswith("thread bystander") for s in sections[2:])
    # Its own stack is noise (other tests' trainers in this process may have left watchdogs of their own).
    assert f"(id {own})" not in text
    assert len(log_lines) == 1
    assert "rank 3 made no progress for" in log_lines[0] and "after step 2;" in log_lines[0]
    # Event.wait waits in threading.py, which called from the blocked line; Lock.acquire waits in C, under it.
    inner = "threading.py:" if blocked is wait_on_event_on_purpose else where
    assert f"the training thread is at {inner}" in log_lines[0], log_lines[0]
    assert log_lines[0].count(where) == 1 and str(path) in log_lines[0]


def test_the_position_names_the_innermost_frame_and_the_runs_innermost_frame():
    import threading as threading_module

    import torch.distributed.distributed_c10d as c10d

    train = str(hang_watchdog._PACKAGE / "train.py")
    collectives = str(hang_watchdog._PACKAGE / "distributed" / "collectives.py")
    user = str(hang_watchdog._PACKAGE.parent / "tests" / "my_hook.py")  # a custom_import module is the run's too
    cases = [
        ([(train, 400, "train"), (collectives, 13, "sum_over"), (c10d.__file__, 2900, "all_reduce")],
         "torch/distributed/distributed_c10d.py:2900 in all_reduce, called from "
         "torchtitan/distributed/collectives.py:13 in sum_over"),
        ([(train, 400, "train"), (user, 7, "wait_here"), (threading_module.__file__, 355, "wait"),
          ("<frozen importlib._bootstrap>", 1, "_call")],
         "<frozen importlib._bootstrap>:1 in _call, called from tests/my_hook.py:7 in wait_here"),
        # The dispatcher under the collective says nothing: the collective is named.
        ([(train, 292, "train_step"), (c10d.__file__, 142, "wait_tensor"), (torch._ops.__file__, 1279, "__call__")],
         "torch/distributed/distributed_c10d.py:142 in wait_tensor, called from torchtitan/train.py:292 in train_step"),
        ([(train, 400, "train"), (collectives, 13, "sum_over")],
         "torchtitan/distributed/collectives.py:13 in sum_over"),
        ([(c10d.__file__, 10, "init")], "torch/distributed/distributed_c10d.py:10 in init"),
    ]
    for frames, expected in cases:
        stack = hang_watchdog.traceback.StackSummary.from_list([(*frame, "") for frame in frames])
        where = hang_watchdog.describe_position(stack)
        assert where == expected or where.endswith(expected) and where.count(" in ") == expected.count(" in "), where


def test_hang_exit_ends_the_process_with_its_code_after_the_log_line(tmp_path, monkeypatch, log_lines):
    exits = []
    monkeypatch.setattr(hang_watchdog.os, "_exit", lambda code: exits.append((code, list(log_lines))))
    clock = FakeClock()
    for exit_on_hang in (False, True):
        w = watchdog(tmp_path / str(exit_on_hang), clock, timeout=5.0, hang_exit=exit_on_hang)
        w.progress(step=1)
        clock.now += 6
        assert w.check()
        w.close()
    assert exits == [(HANG_EXIT_CODE, log_lines[:2])]  # the stacks and the line come first
    assert HANG_EXIT_CODE not in (0, 1, 2)
    assert "ending the process" not in log_lines[0]
    assert log_lines[1].endswith(f"; ending the process (exit code {HANG_EXIT_CODE})")


@pytest.mark.parametrize("device,buffer,written", [("cuda", "2000", True), ("cuda", "0", False),
                                                   ("cuda", None, False), ("cpu", "2000", False)])
def test_the_nccl_flight_recorder_is_dumped_on_cuda_when_enabled(tmp_path, monkeypatch, log_lines, device, buffer,
                                                                 written):
    # A dump of the shape PyTorch's flight recorder writes (its analyzer reads these keys).
    payload = pickle.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "ranks": "[0, 1]"}},
                            "entries": [{"profiling_name": "nccl:all_reduce", "seed": os.urandom(8).hex()}]})
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", lambda: payload, raising=False)
    if buffer is None:
        monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", buffer)
    clock = FakeClock()
    w = HangWatchdog(Observability(hang_timeout_seconds=5.0), 100.0, 300.0, str(tmp_path), 1, torch.device(device),
                     clock=clock, poll_seconds=3600)
    w.progress(step=1)
    clock.now += 6
    assert w.check()
    w.close()
    dump = tmp_path / "hangs" / "nccl_trace" / "rank1"
    assert dump.exists() == written
    if written:
        assert dump.read_bytes() == payload
        # Named so that the analyzer (python -m torch.distributed.flight_recorder.fr_trace hangs/nccl_trace) reads
        # the folder: the prefix inferred, the rank taken from the name.
        from torch.distributed.flight_recorder.components.loader import _determine_prefix, read_dump

        prefix = _determine_prefix(os.listdir(dump.parent))
        read = read_dump(prefix, str(dump))
        assert read["rank"] == 1 and read["entries"] == pickle.loads(payload)["entries"]
        assert f"the NCCL flight recorder in {dump}" in log_lines[0]
    else:
        assert "NCCL" not in log_lines[0]


def test_a_failing_flight_recorder_dump_is_named_in_the_line(tmp_path, monkeypatch, log_lines):
    def broken():
        raise RuntimeError("no process group")

    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", broken, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")
    clock = FakeClock()
    w = HangWatchdog(Observability(hang_timeout_seconds=5.0), 100.0, 300.0, str(tmp_path), 0, torch.device("cuda"),
                     clock=clock, poll_seconds=3600)
    w.progress(step=1)
    clock.now += 6
    assert w.check()
    w.close()
    assert "the NCCL flight recorder's dump failed: RuntimeError: no process group" in log_lines[0]
    assert (tmp_path / "hangs" / "rank0.txt").exists()


def test_the_watchdog_off_starts_no_thread(tmp_path):
    def watchdog_threads():  # other tests' trainers in this process may have left some: count, do not assume none
        return {t.ident for t in threading.enumerate() if t.name == "hang-watchdog"}

    before = watchdog_threads()
    w = HangWatchdog(Observability(hang_watchdog=False), 100.0, 300.0, str(tmp_path), 0, torch.device("cpu"))
    assert watchdog_threads() == before and w._thread is None
    w.progress(step=1, step_seconds=1.0)
    with w.paused():
        pass
    w.close()
    on = HangWatchdog(Observability(), 100.0, 300.0, str(tmp_path), 0, torch.device("cpu"))
    assert watchdog_threads() == before | {on._thread.ident}
    on.close()
    assert watchdog_threads() == before


ABOVE = "is above {largest}, the largest valid value: comm.train_timeout_seconds = {train} less 6 s (the watchdog " \
        "looks every 1 s and the NCCL flight recorder's dump may take 5 s), so that the stacks come before the " \
        "collective timeout ends the job; lower it (0: automatic) or raise comm.train_timeout_seconds"


@pytest.mark.parametrize("settings,train_timeout,expected", [
    # Two values each side of the largest valid one (the collective timeout less the poll and the NCCL dump).
    ({"hang_timeout_seconds": 100.0}, 100, ("observability.hang_timeout_seconds",
                                            ABOVE.format(largest=94, train=100))),
    ({"hang_timeout_seconds": 94.5}, 100, ("observability.hang_timeout_seconds",
                                           ABOVE.format(largest=94, train=100))),
    ({"hang_timeout_seconds": 54.01}, 60, ("observability.hang_timeout_seconds",
                                           ABOVE.format(largest=54, train=60))),
    ({"hang_timeout_seconds": 250.0}, 200, ("observability.hang_timeout_seconds",
                                            ABOVE.format(largest=194, train=200))),
    ({}, 6, ("comm.train_timeout_seconds", "leaves the hang watchdog no time: it needs more than 6 s")),
    ({"hang_timeout_seconds": 1.0}, 3, ("comm.train_timeout_seconds", "leaves the hang watchdog no time")),
    ({"hang_timeout_seconds": -1.0}, 100, ("observability.hang_timeout_seconds", "is invalid; it must be >= 0")),
    ({"hang_timeout_seconds": float("nan")}, 100, ("observability.hang_timeout_seconds",
                                                   "is invalid; it must be >= 0")),
    ({"hang_exit": True, "hang_watchdog": False}, 100, ("observability.hang_exit",
                                                        "needs observability.hang_watchdog, which is off")),
    ({"hang_timeout_seconds": 20.0, "hang_watchdog": False}, 100, ("observability.hang_timeout_seconds",
                                                                   "is set but observability.hang_watchdog is off")),
])
def test_config_problems(settings, train_timeout, expected):
    problems = config_problems(Observability(**settings), Comm(train_timeout_seconds=train_timeout))
    assert len(problems) == 1
    assert problems[0][0] == expected[0] and expected[1] in problems[0][1], problems


@pytest.mark.parametrize("settings,train_timeout", [({}, 100), ({"hang_timeout_seconds": 94.0}, 100),
                                                    ({"hang_timeout_seconds": 93.5}, 100),
                                                    ({"hang_timeout_seconds": 54.0}, 60),
                                                    ({"hang_timeout_seconds": 5.0, "hang_exit": True}, 60),
                                                    ({}, 7), ({"hang_watchdog": False}, 6),
                                                    ({"hang_timeout_seconds": 500.0}, 600)])
def test_config_problems_accept_good_settings(settings, train_timeout):
    assert config_problems(Observability(**settings), Comm(train_timeout_seconds=train_timeout)) == []


@pytest.mark.parametrize("flags,expected", [
    (["--observability.hang_timeout_seconds", "120"],
     "observability.hang_timeout_seconds = 120.0 " + ABOVE.format(largest=94, train=100)),
    (["--observability.hang_timeout_seconds", "15", "--comm.train_timeout_seconds", "20"],
     "observability.hang_timeout_seconds = 15.0 " + ABOVE.format(largest=14, train=20)),
    (["--observability.hang_exit", "--observability.no_hang_watchdog"],
     "observability.hang_exit = True needs observability.hang_watchdog"),
])
def test_the_trainer_refuses_a_hang_timeout_too_close_to_the_collective_timeout_in_one_line(flags, expected, capsys,
                                                                                           tmp_path):
    from torchtitan.train import main

    code = main(["--job.config_file", "train_configs/tiny.toml", f"--job.dump_folder={tmp_path}", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not (tmp_path / "metrics.jsonl").exists()
