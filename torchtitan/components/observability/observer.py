"""What the trainer calls to see its run: a step's phases marked as they end, at each log step every rank's phases
and memory summarised (step_phases.py, rank_summary.py) next to the planner's memory prediction, and the hang
watchdog told of every step and phase (hang_watchdog.py)."""

import contextlib
import json
import time
from pathlib import Path

import torch

from torchtitan.components.observability.hang_watchdog import PAUSED_WORK, HangWatchdog
from torchtitan.components.observability.rank_summary import RankSummary, memory_readings
from torchtitan.components.observability.step_phases import PHASES, StepPhases
from torchtitan.config.job_config import Comm, Observability


class RunObserver:
    def __init__(self, cfg: Observability, dump_folder: str, rank: int, device: torch.device, log_freq: int,
                 planned_memory: dict[str, float] | None, comm: Comm):
        """``planned_memory``: the planner's GiB per part and "total" for this config (None: it could not plan)."""
        self.watchdog = HangWatchdog(cfg, comm.train_timeout_seconds, comm.init_timeout_seconds, dump_folder, rank,
                                     device)
        self.step_start = None
        self.enabled = cfg.record_phases
        self.rank = rank
        self.device = device
        self.phases = StepPhases(cfg, dump_folder, rank, device)
        self.summary = None
        self.planned_gib = None if planned_memory is None else planned_memory["total"]
        if not self.enabled:
            return
        kinds = tuple(memory_readings(device))
        self.summary = RankSummary(cfg, rank, device, window=log_freq, memory_kinds=kinds)
        if rank == 0 and planned_memory is not None:
            folder = Path(dump_folder) / "timeline"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "plan.json").write_text(json.dumps(
                {"device": device.type, "world_size": self.summary.world,
                 "memory_gib": {k: round(v, 4) for k, v in planned_memory.items()}}, indent=1))

    def begin_step(self, step: int) -> None:
        self.step_start = time.perf_counter()
        self.phases.begin(step)
        self.watchdog.progress(phase=PHASES[0])

    def mark(self, phase: str) -> None:
        """The named phase of the running step ends now (step_phases.PHASES, in order)."""
        self.phases.mark(phase)
        following = PHASES.index(phase) + 1
        self.watchdog.progress(phase=PHASES[following] if following < len(PHASES) else "the step's end")

    def paused(self, what: str = PAUSED_WORK) -> contextlib.AbstractContextManager:
        """Around work whose length is not a step's (``what``: a checkpoint save, validation, evaluation): the hang
        watchdog only reports a hang inside, after a long timeout, and never ends the process there."""
        return self.watchdog.paused(what)

    def abandon_step(self) -> None:
        self.phases.abandon()

    def summarise(self) -> dict:
        """At a log step (every rank calls it at the same step, before writing the step's metrics row): gather every
        rank's finished steps since the last summary and its memory now, and return rank 0's metrics for them (the
        other ranks: {}). The running step is not finished: its phases count in the next summary."""
        if not self.enabled:
            return {}
        t0 = time.perf_counter()
        memory = memory_readings(self.device)
        self.phases.note_memory(memory)
        # The previous steps' last device events completed before the loss was read this step: no wait here.
        finished = self.phases.take_finished()
        metrics = self.summary.gather(finished, memory)
        self.phases.write_trace()
        # The all-gather's time is mostly waiting for the last rank to reach this point, not the recorder's work.
        own = self.phases.take_own_seconds() + time.perf_counter() - t0 - self.summary.gather_seconds
        steps = sum(times.total for times in finished)
        if self.rank == 0:
            if self.planned_gib is not None:
                metrics["memory/plan_gib"] = round(self.planned_gib, 4)
            if steps > 0:  # this rank's recorder time (marks, rows, the summary) over the steps it covered
                metrics["observability/overhead_pct"] = round(100 * own / steps, 4)
        return metrics

    def end_step(self, step: int) -> None:
        """The step ends (after its checkpoint phase)."""
        self.phases.end()
        self.watchdog.progress(step, time.perf_counter() - self.step_start)

    def training_ended(self) -> None:
        """What follows training (the teardown, a test's checks) is not a step: the watchdog stops."""
        self.watchdog.close()

    def close(self) -> None:
        self.watchdog.close()
        self.phases.close()
