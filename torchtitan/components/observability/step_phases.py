"""Where each step's time goes on this rank: the phases of a step, timed without adding a synchronisation.

A step is cut into consecutive phases by ``mark(name)`` calls: each phase is the time from the previous mark (or
the step's start) to its own. On CPU the marks read the wall clock. On CUDA they record device events on the
current stream, so a phase is the device timeline's time between two points of the host's program (kernels,
and the gaps where the device waited for the host, e.g. for data), not the host's time to enqueue them; the
events are read once they have completed (``Event.query``), which the trainer's per-step read of the loss
already guarantees for all but the last phases, so reading them adds no synchronisation. The step's start is
also taken on the host's wall clock (unix time): the ranks' phase ends on one time axis, which is what straggler
detection compares (rank_summary.py).

Each rank appends one JSON row per step to ``{dump_folder}/timeline/rank{N}.jsonl`` (rotated to ``.1`` beyond
``observability.max_file_mb``) and keeps the last ``observability.trace_steps`` steps for a Chrome trace,
``timeline/trace_rank{N}.json``, rewritten at every log step and at the end (Perfetto and chrome://tracing open it).
"""

import collections
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchtitan.config.job_config import Observability
from torchtitan.log import logger

# In the order a step runs them; a phase that did not happen in a step (no evaluation, no checkpoint) is 0.
PHASES = ("data", "forward_backward", "grad_comm", "optimizer", "logging", "evaluation", "checkpoint")


@dataclass
class StepTimes:
    """One finished step of this rank: its start (unix seconds) and each phase's seconds."""

    step: int
    start: float
    phases: dict[str, float]
    memory: dict[str, float] | None = None

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def row(self, rank: int, host: str) -> dict:
        row = {"step": self.step, "rank": rank, "host": host, "start": round(self.start, 6),
               "total_s": round(self.total, 6), "phases": {k: round(v, 6) for k, v in self.phases.items()}}
        if self.memory is not None:
            row["memory"] = self.memory
        return row


@dataclass
class _OpenStep:
    step: int
    start: float  # unix seconds
    marks: list[tuple[str, object]] = field(default_factory=list)  # (phase, perf_counter seconds or a CUDA event)
    origin: object = None
    memory: dict[str, float] | None = None


class StepPhases:
    """Times the phases of every step on this rank and writes them (see the module docstring)."""

    def __init__(self, cfg: Observability, dump_folder: str, rank: int, device: torch.device):
        self.cfg = cfg
        self.enabled = cfg.record_phases
        self.rank = rank
        self.host = socket.gethostname()
        self.cuda = device.type == "cuda"
        self.folder = Path(dump_folder) / "timeline"
        self.path = self.folder / f"rank{rank}.jsonl"
        self.trace_path = self.folder / f"trace_rank{rank}.json"
        self.file = None
        self.write_failed = False
        self.open: _OpenStep | None = None
        self.pending: list[_OpenStep] = []  # ended, with CUDA events not yet read
        self.finished: collections.deque[StepTimes] = collections.deque(maxlen=max(cfg.trace_steps, 1))
        self.unreported: list[StepTimes] = []  # finished since the last take_finished()
        self.own_seconds = 0.0  # the recorder's own time since the last take_own_seconds()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, step: int) -> None:
        """The step numbered ``step`` starts now (before its data is fetched)."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self.open = _OpenStep(step, time.time(), origin=self._now())
        self.own_seconds += time.perf_counter() - t0

    def mark(self, phase: str) -> None:
        """The phase ``phase`` of the open step ends now (it began at the previous mark)."""
        if not self.enabled or self.open is None:
            return
        t0 = time.perf_counter()
        self.open.marks.append((phase, self._now()))
        self.own_seconds += time.perf_counter() - t0

    def abandon(self) -> None:
        """The open step is not counted (e.g. redone after a replica group failed during it)."""
        self.open = None

    def note_memory(self, memory: dict[str, float]) -> None:
        """This rank's memory readings (at a log step) go into the running step's row."""
        if self.open is not None:
            self.open.memory = memory

    def end(self) -> None:
        """Close the open step; the steps whose CUDA events have completed are written."""
        if not self.enabled or self.open is None:
            return
        t0 = time.perf_counter()
        self.pending.append(self.open)
        self.open = None
        self._resolve(wait=False)
        self.own_seconds += time.perf_counter() - t0

    def _resolve(self, wait: bool) -> None:
        while self.pending:
            step = self.pending[0]
            last = step.marks[-1][1] if step.marks else step.origin
            if self.cuda:
                if wait:
                    last.synchronize()
                elif not last.query():
                    return
            self.pending.pop(0)
            self._record(self._times(step))

    def _times(self, step: _OpenStep) -> StepTimes:
        phases = dict.fromkeys(PHASES, 0.0)
        previous = step.origin
        for phase, point in step.marks:
            seconds = previous.elapsed_time(point) / 1e3 if self.cuda else point - previous
            phases[phase] = phases.get(phase, 0.0) + seconds
            previous = point
        return StepTimes(step.step, step.start, phases, step.memory)

    def _record(self, times: StepTimes) -> None:
        self.finished.append(times)
        self.unreported.append(times)
        self._write(self._append, times.row(self.rank, self.host))

    def _write(self, write, *args) -> None:
        """The files are a by-product: a full or failing disk stops them (one warning), not the rank, whose peers
        would then wait for it in the next collective."""
        if self.write_failed:
            return
        try:
            write(*args)
        except OSError as e:
            self.write_failed = True
            logger.warning(f"rank {self.rank}: the timeline files under {self.folder} are no longer written ({e}); "
                           "the phases are still summarised")

    def _append(self, row: dict) -> None:
        if self.file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a")
        line = json.dumps(row) + "\n"
        if self.file.tell() + len(line) > self.cfg.max_file_mb * 1e6 and self.file.tell() > 0:
            # Bounded: the older half of the history moves to .1 (replacing the one before).
            self.file.close()
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self.file = self.path.open("a")
        self.file.write(line)
        self.file.flush()  # a crash loses no finished step

    def take_finished(self) -> list[StepTimes]:
        """The steps finished since the last call (all of them: pending CUDA events are waited for)."""
        self._resolve(wait=True)
        taken, self.unreported = self.unreported, []
        return taken

    def take_own_seconds(self) -> float:
        seconds, self.own_seconds = self.own_seconds, 0.0
        return seconds

    def write_trace(self) -> None:
        """The last trace_steps steps as a Chrome trace (complete events; one process per rank)."""
        if self.enabled and self.finished:
            self._write(self._write_trace)

    def _write_trace(self) -> None:
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                   "args": {"name": f"rank {self.rank} ({self.host})"}}]
        for times in self.finished:
            ts = times.start * 1e6
            events.append({"name": f"step {times.step}", "ph": "X", "ts": round(ts, 1),
                           "dur": round(times.total * 1e6, 1), "pid": self.rank, "tid": 0,
                           "args": {"step": times.step}})
            for phase, seconds in times.phases.items():
                if seconds > 0:
                    events.append({"name": phase, "ph": "X", "ts": round(ts, 1), "dur": round(seconds * 1e6, 1),
                                   "pid": self.rank, "tid": 1, "args": {"step": times.step}})
                ts += seconds * 1e6
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.trace_path.with_name(self.trace_path.name + ".partial")
        partial.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(partial, self.trace_path)  # a reader never sees half a file

    def close(self) -> None:
        if not self.enabled:
            return
        self._resolve(wait=True)
        self.write_trace()
        if self.file is not None:
            self._write(self.file.close)
            self.file = None
