"""Reward functions by name, and the pool of worker processes that scores completions with them.

A reward function is ``fn(completion: str, sample: dict) -> float``. ``completion`` is the text the policy generated
for ``sample["prompt"]``, decoded without its stop token (the end-of-text token that ended it); ``sample`` is the
prompt source's sample (torchtitan/rl/tasks.py: the answer and whatever else the task put there). Functions are
registered by name with `register_reward`; a module named in experimental.custom_import registers its own beside the
built-ins. A completion's reward is the weighted sum of the functions rl.rewards names (rl.reward_weights, 1 each
when empty).

Built-ins, for tasks whose answer is an integer (the arithmetic task):

* ``exact_answer``: 1 when the completion, surrounding whitespace stripped, is an integer written in ASCII digits
  with an optional leading minus and nothing else, equal to ``sample["answer"]`` as an integer (leading zeros and
  "-0" read as integers do); else 0. "42" and " 42\\n" score for the answer "42"; "The answer is 42", "42." and
  "+42" do not. Reading only a bare answer leaves nothing to game: a completion that lists many numbers, or does not
  stop, gets nothing. An answer that is not an integer makes the call fail (counted, below).
* ``format``: 1 when the stripped completion is such a bare integer, right or wrong; else 0.

`RewardPool` calls them. With rl.reward_workers >= 1 it runs them in that many worker processes, one call at a time
per worker, each with rl.reward_timeout_seconds. A worker is a fresh interpreter (a subprocess: never a fork, which
is unsafe in a process that runs threads, as the trainer does; nor multiprocessing's spawn or forkserver, which
would run the trainer's main module, torch and all, again in every worker and every replacement): it starts in
about 0.1 s and imports this module, the functions' modules and what they import. A call that raises, runs past its
timeout, kills its worker, or returns anything but a finite number scores 0 and is counted per function; it never
ends the run. A worker whose call times out is killed (SIGKILL: a hung function need not cooperate) and replaced,
so a stuck call costs its timeout and leaves no process behind (processes the function itself started are its own
business). The functions travel to the workers pickled by reference, so each must be defined at the top level of a
module the workers can import (not a lambda or a function inside another). With 0 workers the functions run in the
calling process with no timeout (a hung function hangs the caller): for debugging, and for functions that cannot
be pickled.

Rewards that execute the completion (code, unit tests) are out of scope: they need a sandbox without network and
with memory limits, which the worker processes are not.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from torchtitan.log import one_line
from torchtitan.registry import Registry
from torchtitan.stop_signals import STOP_SIGNALS

if TYPE_CHECKING:
    from torchtitan.config.job_config import RL

RewardFn = Callable[[str, dict], float]

REWARDS: Registry[RewardFn] = Registry("reward function")

# How long a worker may take to start and load the functions before the pool gives up on it.
STARTUP_TIMEOUT_SECONDS = 120.0


def register_reward(name: str, fn: RewardFn) -> None:
    """Register ``fn(completion, sample) -> float`` as reward ``name`` (see the module doc for what runs in
    workers)."""
    if not callable(fn):
        raise TypeError(f"reward {name!r}: {fn!r} is not callable")
    REWARDS.register(name, fn)


# An integer in ASCII digits: its sign and its digits without leading zeros.
_INTEGER = re.compile(r"(-?)0*([0-9]+)", re.ASCII)


def _integer(text: str) -> str | None:
    """The canonical form of ``text`` if it is a bare integer ("-007" -> "-7", "-0" -> "0"), else None."""
    match = _INTEGER.fullmatch(text)
    if match is None:
        return None
    sign, digits = match.groups()
    return digits if digits == "0" else sign + digits


def exact_answer(completion: str, sample: dict) -> float:
    """1.0 when the stripped completion is a bare integer equal to sample["answer"]."""
    answer = _integer(str(sample["answer"]).strip())
    if answer is None:
        raise ValueError(f"the sample's answer {sample['answer']!r:.40} is not an integer")
    return float(_integer(completion.strip()) == answer)


def format_reward(completion: str, sample: dict) -> float:
    """1.0 when the stripped completion is a bare integer (right or wrong)."""
    return float(_integer(completion.strip()) is not None)


register_reward("exact_answer", exact_answer)
register_reward("format", format_reward)


# ----------------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RewardScores:
    """The scores of one `RewardPool.score` call."""

    total: list[float]  # each completion's weighted sum
    per_function: dict[str, list[float]]  # each function's reward of each completion (0 where the call failed)
    failures: dict[str, int]  # each function's failed calls (raised, timed out, worker died, not a finite number)
    first_errors: dict[str, str]  # for each function that failed, its first failure in one line


Outcome = tuple[bool, "float | str"]  # (True, reward) or (False, why the call failed)


def _call(fn: RewardFn, completion: str, sample: dict) -> Outcome:
    """One reward call, its failure caught (in the worker or, with no workers, in the caller)."""
    try:
        value = fn(completion, sample)
        if not isinstance(value, numbers.Real):
            return False, f"returned {type(value).__name__} {value!r:.40}, not a number"
        value = float(value)
    except (Exception, SystemExit) as e:  # a reward function's bug must not end the run: it scores 0, counted
        return False, one_line(e)
    if not math.isfinite(value):
        return False, f"returned {value}, not a finite number"
    return True, value


def start_child(module: str, function: str, *args) -> tuple[subprocess.Popen, Connection]:
    """A fresh interpreter running ``module.function(fd, *args)`` (``fd``: its end of a socket pair), and this
    process's end as a Connection. Not a fork (a trainer has threads) and not multiprocessing's spawn, which re-runs
    the trainer's main module in the child: about 0.1 s to start instead of seconds. The child gets this process's
    sys.path first, so it imports this package and the user's modules from where this process did."""
    ours, theirs = socket.socketpair()
    call = ", ".join(map(repr, (theirs.fileno(), *args)))
    code = f"import sys; sys.path[:0] = {sys.path!r}; from {module} import {function}; {function}({call})"
    try:
        process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
    finally:
        theirs.close()
    return process, Connection(ours.detach())


def exit_with_parent(parent: int, cleanup: Callable[[], None] = lambda: None) -> None:
    """Run in a thread of a worker process: end it (after ``cleanup``) once ``parent`` is gone. A pool that was never
    closed ends with its process; a worker stuck in a call would outlive it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    cleanup()
    os._exit(0)


def _worker_main(fd: int) -> None:
    """A worker's loop on its end of the socket ``fd``: receive the functions (pickled by reference), then answer
    each (function index, completion, sample) with an Outcome until told to stop (None) or the pool goes away."""
    # Ctrl-C and a scheduler's stop notice are for the training process to act on; it ends the workers.
    for sig in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    try:
        functions = pickle.loads(conn.recv())
    except Exception as e:  # e.g. the module that defines a function does not import here
        conn.send(("broken", one_line(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, completion, sample = task
        conn.send(("done", _call(functions[index], completion, sample)))


class _Worker:
    """One worker process, the pool's end of its socket, and the call it is running (function, completion) if any."""

    def __init__(self, payload: bytes):
        self.process, self.conn = start_child("torchtitan.rl.rewards", "_worker_main")
        self.conn.send(payload)
        self.started = time.monotonic()
        self.ready = False
        self.task: tuple[int, int] | None = None
        self.deadline = math.inf

    def stop(self, kill: bool) -> None:
        if not kill:
            try:
                self.conn.send(None)
                self.process.wait(timeout=1.0)
            except (OSError, subprocess.TimeoutExpired):  # gone already, or busy: killed below
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


def _unpicklable(fn: RewardFn) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:  # whatever pickling raises: the function cannot reach a worker
        return True
    return False


def _problems(names: Sequence[str], weights: Sequence[float], workers: int,
              timeout_seconds: float) -> list[tuple[str, str]]:
    """(field of [rl], reason) for these reward settings; shared by config_problems and RewardPool."""
    problems = []
    registered = ", ".join(REWARDS.names())
    unknown = [name for name in names if name not in REWARDS]
    repeated = [name for i, name in enumerate(names) if name in names[:i]]
    if not names:
        problems.append(("rewards", f"is empty; name at least one registered reward function: {registered}"))
    elif unknown:
        problems.append(("rewards", f"names {unknown[0]!r}, which is no registered reward function; registered: "
                                    f"{registered} (a module named in experimental.custom_import can register one "
                                    "with torchtitan.rl.rewards.register_reward)"))
    elif repeated:
        problems.append(("rewards", f"names {repeated[0]!r} twice; name each once (rl.reward_weights weighs them)"))
    elif workers > 0 and (unsendable := [name for name in names if _unpicklable(REWARDS.get(name))]):
        problems.append(("rewards", f"names {unsendable[0]!r}, which cannot be sent to the reward worker processes "
                                    "(it is not picklable: a lambda, or a function defined inside another); define it "
                                    "at the top level of a module, or set rl.reward_workers = 0 to score in the "
                                    "trainer"))
    if len(weights) not in (0, len(names)):
        problems.append(("reward_weights", f"has {len(weights)} weights for {len(names)} rewards (rl.rewards); give "
                                           "one per reward, or none (1 each)"))
    elif not all(math.isfinite(weight) for weight in weights):
        problems.append(("reward_weights", "holds a weight that is not a finite number"))
    if workers < 0:
        problems.append(("reward_workers", "is invalid; it must be >= 0 (0: score in the trainer, with no timeout)"))
    if not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
        problems.append(("reward_timeout_seconds", "is invalid; it must be a finite number > 0"))
    return problems


def config_problems(rl: RL) -> list[tuple[str, str]]:
    """(field of [rl], reason) for the reward settings (after custom modules are imported)."""
    return _problems(rl.rewards, rl.reward_weights, rl.reward_workers, rl.reward_timeout_seconds)


class RewardPool:
    """Scores completions with the named reward functions, in ``workers`` processes (0: in this one); see the
    module doc. Close it (or use it as a context manager) to end the workers."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] = (), workers: int = 0,
                 timeout_seconds: float = 10.0):
        names, weights = list(names), [float(weight) for weight in weights]
        problems = _problems(names, weights, workers, timeout_seconds)
        if problems:
            field, reason = problems[0]
            value = {"rewards": names, "reward_weights": weights, "reward_workers": workers,
                     "reward_timeout_seconds": timeout_seconds}[field]
            raise ValueError(f"rl.{field} = {value!r} {reason}")
        self.names, self.weights = names, weights or [1.0] * len(names)
        self.functions = [REWARDS.get(name) for name in names]
        self.timeout_seconds = timeout_seconds
        self._workers: list[_Worker] = []
        if workers:
            self._payload = pickle.dumps(self.functions)
            try:
                for _ in range(workers):
                    self._workers.append(_Worker(self._payload))
                self._drive(deque(), [], [], lambda task, outcome: None)  # until every worker is ready
            except BaseException:
                self.close(kill=True)
                raise

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, kill: bool = False) -> None:
        """End the workers (at once with ``kill``); the pool cannot score afterwards."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop(kill)

    def score(self, completions: Sequence[str], samples: Sequence[dict]) -> RewardScores:
        """Each completion's rewards against its sample (completions[i] answers samples[i]); failed calls score 0
        and are counted, never raised (RuntimeError only if a replacement worker cannot start)."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions for {len(samples)} samples; give one sample per "
                             "completion")
        values = [[0.0] * len(completions) for _ in self.functions]
        failures, first_errors = [0] * len(self.functions), {}

        def record(task: tuple[int, int], outcome: Outcome) -> None:
            (function, completion), (ok, value) = task, outcome
            if ok:
                values[function][completion] = value
            else:
                failures[function] += 1
                first_errors.setdefault(self.names[function], value)

        tasks = deque((f, c) for c in range(len(completions)) for f in range(len(self.functions)))
        if self._workers:
            self._drive(tasks, completions, samples, record)
        else:
            for task in tasks:
                record(task, _call(self.functions[task[0]], completions[task[1]], samples[task[1]]))
        total = [sum(weight * values[f][c] for f, weight in enumerate(self.weights)) for c in range(len(completions))]
        return RewardScores(total, dict(zip(self.names, values)), dict(zip(self.names, failures)), first_errors)

    def _restart(self, index: int) -> None:
        self._workers[index].stop(kill=True)
        self._workers[index] = _Worker(self._payload)

    def _drive(self, tasks: deque, completions: Sequence[str], samples: Sequence[dict],
               record: Callable[[tuple[int, int], Outcome], None]) -> None:
        """Run ``tasks`` (function, completion) on the workers until all are recorded and every worker is ready."""
        for index, worker in enumerate(self._workers):
            if worker.task is not None:  # a call left running by an interrupted score(): its answer is stale
                self._restart(index)
        while True:
            for index, worker in enumerate(self._workers):
                while worker.ready and worker.task is None and tasks:
                    function, completion = task = tasks.popleft()
                    try:
                        worker.conn.send((function, completions[completion], samples[completion]))
                    except (OSError, EOFError):  # the worker died while idle: the call goes to its replacement
                        tasks.appendleft(task)
                        self._restart(index)
                        break
                    except Exception as e:  # the sample does not pickle: nothing was sent
                        record(task, (False, f"cannot send the sample to a worker: {one_line(e)}"))
                        continue
                    worker.task, worker.deadline = task, time.monotonic() + self.timeout_seconds
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            if not waiting and not tasks:
                return
            deadline = min(w.deadline if w.ready else w.started + STARTUP_TIMEOUT_SECONDS for w in waiting)
            # A worker that dies closes its socket: that wakes the wait too.
            wait([w.conn for w in waiting], timeout=max(0.0, deadline - time.monotonic()))
            for index, worker in enumerate(self._workers):
                self._collect(index, worker, record)
            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                if worker.task is not None and now >= worker.deadline:
                    record(worker.task, (False, f"timed out after {self.timeout_seconds:g} s"))
                    self._restart(index)
                elif not worker.ready and now >= worker.started + STARTUP_TIMEOUT_SECONDS:
                    raise RuntimeError(f"a reward worker did not start within {STARTUP_TIMEOUT_SECONDS:g} s")

    def _collect(self, index: int, worker: _Worker, record: Callable[[tuple[int, int], Outcome], None]) -> None:
        """Take the worker's message if one is waiting; replace the worker if it died."""
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = ("died", None)
        if message is None:
            if worker.process.poll() is None:
                return
            message = ("died", None)
        kind, content = message
        if kind == "ready":
            worker.ready = True
        elif kind == "done":
            record(worker.task, content)
            worker.task = None
        elif kind == "broken":
            raise RuntimeError(f"a reward worker cannot load the reward functions {', '.join(self.names)}: {content}")
        else:  # died
            try:
                code = worker.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:  # it closed its socket but lives on: replaced all the same
                code = None
            if not worker.ready:
                raise RuntimeError(f"a reward worker exited (code {code}) while starting")
            if worker.task is not None:
                record(worker.task, (False, f"the worker died during the call (exit code {code})"))
            self._restart(index)
