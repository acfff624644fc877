"""The hang watchdog (observability.hang_watchdog): a daemon thread per rank that notices when training stopped
making progress, and says where each rank is before the job is torn down.

The trainer calls ``progress`` at every step's end (with the step's duration) and at phase boundaries; each call,
like entering or leaving ``paused()``, restarts the clock. When none came for the timeout in effect, the thread
- appends every thread's Python stack to ``{dump_folder}/hangs/rank{R}.txt``, the training thread's first, with
  the last finished step, the seconds since the last progress, the phase last entered and the paused work;
- on CUDA with the NCCL flight recorder on (TORCH_NCCL_TRACE_BUFFER_SIZE > 0), writes its dump (a pickle) to
  ``hangs/nccl_trace/rank{R}``;
- logs one warning line naming where the training thread is;
- with observability.hang_exit, and outside the report-only situations below, ends the process with
  HANG_EXIT_CODE so torchrun tears the job down and a scheduler may requeue it.
It fires once per hang; later progress re-arms it.

The timeout in effect, from the watchdog's start (the trainer builds it after the process group, before loading a
checkpoint):
- before this process finished a step (loading a checkpoint, the first step's compilation and NCCL setup, whose
  collectives run under comm.init_timeout_seconds): capped(comm.init_timeout_seconds), report-only;
- inside ``paused()`` (checkpoint saves, validation, task evaluation), once a step finished: capped(
  comm.train_timeout_seconds), report-only;
- otherwise an explicit hang_timeout_seconds; the automatic one (hang_timeout_seconds = 0) once three steps
  finished: 10x the median duration of the finished steps (the first left out), at least 30 s and at most
  capped(comm.train_timeout_seconds); nothing before.
Report-only: those may legitimately be long (a first compilation, a long validation), so a hang there is reported
but the process not ended, even with hang_exit; the collective timeout ends a real one. capped() is 0.8x the
collective timeout, and every timeout leaves POLL_SECONDS + NCCL_DUMP_WAIT_SECONDS before it, which otherwise ends
the job first, without stacks: the thread notices a hang up to a poll late and the NCCL dump may take that long
(config_problems checks an explicit timeout). The trainer closes the watchdog when train() returns: the teardown
after the last step is not watched.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import site
import socket
import statistics
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch

from torchtitan.config.job_config import Comm, Observability
from torchtitan.log import logger, one_line

HANG_EXIT_CODE = 3  # the process status with hang_exit (1: a training error, 2: bad input)
AUTO_MULTIPLE = 10.0  # the automatic timeout: this many median steps ...
AUTO_MIN_SECONDS = 30.0  # ... at least this long ...
CAP_FRACTION = 0.8  # ... and at most this fraction of the collective timeout (capped())
AUTO_MIN_STEPS = 3  # steps finished before the automatic timeout arms
POLL_SECONDS = 1.0  # how often the thread looks (how late past the timeout it may fire)
NCCL_DUMP_WAIT_SECONDS = 5.0  # the flight recorder's dump takes its lock: never let it hold the exit up longer
_DURATIONS_KEPT = 100  # the median is over the last this many steps
PAUSED_WORK = "a checkpoint save, validation or evaluation"  # what a paused() not told what it covers says
_START = "the start (loading a checkpoint, compiling and setting up the collectives in the first step)"
_MARGIN_SECONDS = POLL_SECONDS + NCCL_DUMP_WAIT_SECONDS
_MARGIN = (f"the watchdog looks every {POLL_SECONDS:g} s and the NCCL flight recorder's dump may take "
           f"{NCCL_DUMP_WAIT_SECONDS:g} s")


def largest_timeout(collective_timeout_seconds: float) -> float:
    """The longest hang timeout under this collective timeout: a hang is noticed up to POLL_SECONDS late and its
    NCCL dump may take NCCL_DUMP_WAIT_SECONDS, all before the collective timeout ends the job without stacks."""
    return collective_timeout_seconds - _MARGIN_SECONDS


def capped(collective_timeout_seconds: float) -> float:
    """The longest timeout the watchdog picks itself under this collective timeout (the automatic one, the
    report-only ones): CAP_FRACTION of it, within the margin of largest_timeout."""
    return min(CAP_FRACTION * collective_timeout_seconds, largest_timeout(collective_timeout_seconds))


def config_problems(observability: Observability, comm: Comm) -> list[tuple[str, str]]:
    """Problems with the hang watchdog's settings as (full key, reason) pairs; they span [observability] and
    [comm]."""
    timeout, on = observability.hang_timeout_seconds, observability.hang_watchdog
    key = "observability.hang_timeout_seconds"
    problems = []
    if not math.isfinite(timeout) or timeout < 0:
        problems.append((key, "is invalid; it must be >= 0 (0: 10x the median step, at least 30 s, at most "
                              f"0.8x comm.train_timeout_seconds and {_MARGIN_SECONDS:g} s below it)"))
    elif on and largest_timeout(comm.train_timeout_seconds) <= 0:
        problems.append(("comm.train_timeout_seconds", f"leaves the hang watchdog no time: it needs more than "
                                                       f"{_MARGIN_SECONDS:g} s ({_MARGIN}) before the collective "
                                                       f"timeout ends the job; raise it above {_MARGIN_SECONDS:g} or "
                                                       "turn observability.hang_watchdog off"))
    elif on and timeout > largest_timeout(comm.train_timeout_seconds):
        largest = largest_timeout(comm.train_timeout_seconds)
        problems.append((key, f"is above {largest:g}, the largest valid value: comm.train_timeout_seconds = "
                              f"{comm.train_timeout_seconds} less {_MARGIN_SECONDS:g} s ({_MARGIN}), so that the "
                              "stacks come before the collective timeout ends the job; lower it (0: automatic) or "
                              "raise comm.train_timeout_seconds"))
    elif not on and timeout != 0:
        problems.append((key, "is set but observability.hang_watchdog is off, which would ignore it; turn the "
                              "watchdog on or leave it at 0"))
    if observability.hang_exit and not on:
        problems.append(("observability.hang_exit", "needs observability.hang_watchdog, which is off (nothing would "
                                                    "notice the hang); turn the watchdog on or leave hang_exit off"))
    return problems


def auto_timeout(step_seconds: list[float], train_timeout_seconds: float) -> float:
    """The automatic hang timeout for steps of these durations; the cap wins over the floor, so a short collective
    timeout still gets stacks first."""
    wanted = max(AUTO_MULTIPLE * statistics.median(step_seconds), AUTO_MIN_SECONDS)
    return min(wanted, capped(train_timeout_seconds))


class HangWatchdog:
    """See the module doc. ``clock`` and ``poll_seconds`` are for tests."""

    def __init__(self, cfg: Observability, train_timeout_seconds: float, init_timeout_seconds: float,
                 dump_folder: str, rank: int, device: torch.device, *, clock=time.monotonic,
                 poll_seconds: float = POLL_SECONDS, exit_grace_seconds: float = 2 * POLL_SECONDS):
        self.cfg = cfg
        self.exit_grace_seconds = exit_grace_seconds
        self.train_timeout_seconds = train_timeout_seconds
        self.init_timeout_seconds = init_timeout_seconds
        self.folder = Path(dump_folder) / "hangs"
        self.rank = rank
        self.device = device
        self.clock = clock
        self.fired = 0  # hangs reported since the start
        self._lock = threading.Lock()
        self._last = clock()  # when progress was last made
        self._steps = 0  # steps finished in this process
        self._step: int | None = None  # the last finished step's number
        self._phase: str | None = None
        self._durations: deque[float] = deque(maxlen=_DURATIONS_KEPT)
        self._paused: list[str] = []  # the work of each paused() the training thread is in, innermost last
        self._reported = False  # the current hang has been reported
        # The thread whose stack matters most: the one training (the trainer builds the watchdog there).
        self._watched = threading.get_ident()
        self._stop = threading.Event()
        self._thread = None
        if cfg.hang_watchdog:
            self._thread = threading.Thread(target=self._run, args=(poll_seconds,), name="hang-watchdog",
                                            daemon=True)
            self._thread.start()

    def progress(self, step: int | None = None, step_seconds: float | None = None, phase: str | None = None) -> None:
        """Training moved on: at a phase boundary (``phase``: the phase entered) or at a step's end (``step``: its
        number; ``step_seconds``: its duration, which the automatic timeout is the median of)."""
        with self._lock:
            self._moved_on()
            if step is not None:
                self._steps += 1
                self._step = step
                self._phase = None  # a step's end: no phase of the next step entered yet
                if step_seconds is not None and self._steps > 1:  # the first step warms up
                    self._durations.append(step_seconds)
            if phase is not None:
                self._phase = phase

    @contextlib.contextmanager
    def paused(self, what: str = PAUSED_WORK):
        """Around work whose length is not a step's (``what``: a checkpoint save, validation, evaluation, as the
        log line names it): inside, only a hang past the long report-only timeout is reported; entering and
        leaving are progress."""
        with self._lock:
            self._paused.append(what)
            self._moved_on()
        try:
            yield
        finally:
            with self._lock:
                self._paused.pop()
                self._moved_on()

    def timeout(self) -> float | None:
        """Seconds without progress that count as a hang now; None while not watched."""
        return self._rule()[0]

    def _rule(self) -> tuple[float | None, str | None]:
        """The timeout in effect (None: not watched) and, where a hang is only reported (the process is never
        ended there), the log line's clause saying why (None: the normal rules)."""
        if self._steps < 1 or self._paused:
            # Legitimately long at times (a first compilation, a long validation): a timeout just inside the
            # collective timeout in effect there, which is what ends a real hang.
            field, seconds = (("comm.init_timeout_seconds", self.init_timeout_seconds) if self._steps < 1
                              else ("comm.train_timeout_seconds", self.train_timeout_seconds))
            timeout = capped(seconds)
            if timeout <= 0:  # a collective timeout too short to get stacks before it
                return None, None
            work = self._paused[-1] if self._paused else _START
            return timeout, (f"; only reported, the process is not ended: {work} may legitimately take long, and "
                             f"the collective timeout ({field} = {seconds:g} s) ends a real hang")
        if self.cfg.hang_timeout_seconds > 0:
            return self.cfg.hang_timeout_seconds, None
        if self._steps < AUTO_MIN_STEPS or not self._durations:
            return None, None
        return auto_timeout(list(self._durations), self.train_timeout_seconds), None

    def check(self) -> bool:
        """Report a hang if there is one not yet reported; whether it did (the thread calls this)."""
        with self._lock:
            timeout, report_only = self._rule()
            idle = self.clock() - self._last
            if self._reported or timeout is None or idle < timeout or self._stop.is_set():
                return False
            self._reported = True
            where = f"after step {self._step}" if self._steps else "before this process's first step finished"
            if self._phase:
                where += f", in phase {self._phase}"
            if self._paused:
                where += f", during {self._paused[-1]}"
        self.fired += 1
        self._report(where, idle, timeout, report_only)
        return True

    def _moved_on(self) -> None:
        """Progress (the caller holds the lock): the clock restarts and a later hang is a new one."""
        self._last = self.clock()
        self._reported = False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, poll_seconds: float) -> None:
        while not self._stop.wait(poll_seconds):
            try:
                self.check()
            except Exception as e:  # a watchdog that died silently would be worse than one that says so
                logger.warning(f"the hang watchdog stopped: {one_line(e)}")
                return

    def _report(self, when: str, idle: float, timeout: float, report_only: str | None) -> None:
        """``when``: the last finished step, the phase, the paused work; ``report_only``: None, or the clause
        saying why the process is not ended."""
        stacks = self.folder / f"rank{self.rank}.txt"
        try:
            where = self._write_stacks(stacks, f"no progress for {idle:.1f} s (timeout {timeout:g} s) {when}")
            wrote = f"every thread's stack in {stacks}"
        except Exception as e:  # the line below must still say what is known
            where, wrote = "an unknown place", f"writing {stacks} failed: {one_line(e)}"
        nccl = self._dump_flight_recorder()
        end = self.cfg.hang_exit and not report_only
        ending = report_only or (f"; ending the process (exit code {HANG_EXIT_CODE})" if end else "")
        logger.warning(f"hang: rank {self.rank} made no progress for {idle:.1f} s (timeout {timeout:g} s) {when}; "
                       f"the training thread is at {where}; {wrote}{nccl}{ending}")
        if end:
            _flush_output()
            # The peers' watchdogs fire within a poll or so of ours (they wait for this rank since about when it
            # stopped); ending at once would fail their collective before they wrote their stacks.
            time.sleep(self.exit_grace_seconds)
            # The training thread is stuck, possibly inside C++: only ending the process from here works.
            os._exit(HANG_EXIT_CODE)

    def _write_stacks(self, path: Path, headline: str) -> str:
        """Append every thread's stack to ``path``; return where the training thread is."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        own = threading.get_ident()
        order = sorted((ident for ident in frames if ident != own), key=lambda ident: ident != self._watched)
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        lines = [f"=== hang watchdog: rank {self.rank}, host {socket.gethostname()}, pid {os.getpid()}, {when}",
                 headline, "(each stack runs from the outermost call to the innermost)"]
        where = "no Python frame"
        for ident in order:
            stack = traceback.extract_stack(frames[ident])
            role = "training thread" if ident == self._watched else "thread"
            lines.append(f"\n--- {role} {names.get(ident, '?')} (id {ident})")
            lines.extend(line.rstrip("\n") for line in traceback.format_list(stack))
            if ident == self._watched:
                where = describe_position(stack)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # a second hang (or a relaunch's) keeps the first one's stacks
            f.write("\n".join(lines) + "\n\n")
        return where

    def _dump_flight_recorder(self) -> str:
        """The NCCL flight recorder's dump, where there is one: a clause for the log line ("" if none)."""
        try:
            enabled = int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")) > 0
        except ValueError:
            enabled = False
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        if self.device.type != "cuda" or not enabled or dump is None:
            return ""
        # hangs/nccl_trace/rank{R}: the layout PyTorch's analyzer reads (python -m
        # torch.distributed.flight_recorder.fr_trace FOLDER: one file per rank, named PREFIX<rank>).
        path = self.folder / "nccl_trace" / f"rank{self.rank}"
        outcome: list[str] = []

        def write() -> None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(dump())
                outcome.append(f"; the NCCL flight recorder in {path}")
            except Exception as e:  # whatever the recorder raises, the stacks and the line still come
                outcome.append(f"; the NCCL flight recorder's dump failed: {one_line(e)}")

        worker = threading.Thread(target=write, name="hang-watchdog-nccl-dump", daemon=True)
        worker.start()
        worker.join(NCCL_DUMP_WAIT_SECONDS)
        return outcome[0] if outcome else f"; the NCCL flight recorder's dump did not finish in " \
                                          f"{NCCL_DUMP_WAIT_SECONDS:g} s"


def describe_position(stack: traceback.StackSummary) -> str:
    """Where a stack is: its innermost frame (the innermost torch.distributed one, the collective waited in, when
    there is one below the run's code: the dispatcher under it says nothing) and, when that is library code
    (torch, Python's own), the innermost frame of the run's code (torchtitan, a custom_import module), e.g. the
    trainer's line that called the collective."""
    if not stack:
        return "no Python frame"
    ours = next((i for i in reversed(range(len(stack))) if _is_run_code(stack[i].filename)), None)
    below = stack[ours + 1:] if ours is not None else stack
    collective = next((f for f in reversed(below) if _is_collective(f.filename)), None)
    where = _frame(collective or stack[-1])
    if ours is not None and ours != len(stack) - 1:
        where += f", called from {_frame(stack[ours])}"
    return where


_PACKAGE = Path(__file__).resolve().parents[2]
_LIBRARIES = {Path(p).resolve() for p in [*(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib",
                                                                                  "platlib")),
                                          *site.getsitepackages(), site.getusersitepackages()]}


def _is_run_code(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: the interpreter's
        return False
    path = Path(filename).resolve()
    return path.is_relative_to(_PACKAGE) or not any(path.is_relative_to(lib) for lib in _LIBRARIES)


def _is_collective(filename: str) -> bool:
    return "/torch/distributed/" in Path(filename).as_posix()


def _frame(frame: traceback.FrameSummary) -> str:
    return f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def _short_path(filename: str) -> str:
    """The file as its import path shows it (torch/distributed/..., torchtitan/..., tests/...), not the
    install's absolute path."""
    path = Path(filename).resolve()
    roots = sorted((Path(p).resolve() for p in sys.path if p), key=lambda p: len(p.parts), reverse=True)
    for root in roots:
        if path.is_relative_to(root) and path != root:
            return str(path.relative_to(root))
    return filename


def _flush_output() -> None:
    for handler in [*logger.handlers, *logging.getLogger().handlers]:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
