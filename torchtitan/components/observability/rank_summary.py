"""Every log step, all ranks' step phases and memory in one place: min/median/max and who is slowest, and stragglers.

Each rank sends one small tensor (its steps since the last log step: step, start, phase seconds; and its memory
readings) in one all-gather over the default group; rank 0 summarises it into the metrics row and names
stragglers. One collective per log step, on a tensor of (log_freq + 1) x 9 numbers per rank.

A straggler is a rank that falls behind the others, not one whose step is long: the ranks of a synchronous step
wait for each other inside its collectives, so every rank's step lasts as long as the slowest one's and the
waiting shows up in the phase where the others wait, not in the slow rank's. What tells them apart is *when*
each rank reaches the end of each phase, on the common clock of the step starts (unix time; hosts are assumed
NTP-synchronised to well under a step): a rank is behind at a step when it reaches some phase's end later than
the median rank (of an even count, the lower middle one) by more than ``straggler_fraction`` of the median step time, and it fell behind in the phase
where its lag grew most. Behind for ``straggler_steps`` consecutive steps, it is named in one log line (rank,
host, phase, lag) and counted in ``straggler/events``.
"""

import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from torchtitan.components.observability.lag import lag_behind, phase_end_lags
from torchtitan.components.observability.step_phases import PHASES, StepTimes
from torchtitan.config.job_config import Observability
from torchtitan.log import logger

GIB = 2**30


def memory_readings(device: torch.device) -> dict[str, float]:
    """This process's memory now, in GiB: allocated and reserved (and their peaks) on CUDA; resident set size
    now and at its peak on CPU."""
    if device.type == "cuda":
        return {"allocated_gib": torch.cuda.memory_allocated(device) / GIB,
                "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
                "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
    readings = {}
    try:
        with open("/proc/self/statm") as f:  # Linux: the second field is resident pages
            readings["rss_gib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except OSError:
        pass
    readings["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {kind: round(value, 4) for kind, value in readings.items()}


def config_problems(cfg: Observability) -> list[tuple[str, str]]:
    problems = []
    if not (math.isfinite(cfg.max_file_mb) and cfg.max_file_mb > 0):
        problems.append(("max_file_mb", "is invalid; it must be a number > 0"))
    if cfg.trace_steps < 1:
        problems.append(("trace_steps", "is invalid; it must be >= 1"))
    if not (math.isfinite(cfg.straggler_fraction) and cfg.straggler_fraction > 0):
        problems.append(("straggler_fraction", "is invalid; it must be a number > 0"))
    if cfg.straggler_steps < 1:
        problems.append(("straggler_steps", "is invalid; it must be >= 1"))
    if not cfg.record_phases:
        default = Observability()
        for name in ("max_file_mb", "trace_steps", "straggler_fraction", "straggler_steps"):
            if getattr(cfg, name) != getattr(default, name):
                problems.append((name, "is set but observability.record_phases is off, so nothing would use it; "
                                       "turn record_phases on or leave it at its default"))
    return problems


class RankSummary:
    """Gathers each log window's steps and memory from every rank; rank 0 turns them into metrics."""

    def __init__(self, cfg: Observability, rank: int, device: torch.device, window: int,
                 memory_kinds: tuple[str, ...]):
        """``window``: the most steps between two log steps (metrics.log_freq)."""
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.window = window
        self.memory_kinds = memory_kinds
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.world = dist.get_world_size() if self.distributed else 1
        self.hosts = [None] * self.world
        if self.distributed:
            dist.all_gather_object(self.hosts, os.uname().nodename)
        else:
            self.hosts = [os.uname().nodename]
        self.stragglers = StragglerDetector(cfg, self.hosts)
        self.gather_seconds = 0.0  # the last all-gather's

    def gather(self, steps: list[StepTimes], memory: dict[str, float]) -> dict:
        """All ranks call this at the same log step; rank 0 returns the metrics (others an empty dict)."""
        columns = 2 + len(PHASES)
        local = torch.full((self.window + 1, columns), float("nan"), dtype=torch.float64)
        for kind_index, kind in enumerate(self.memory_kinds):
            if kind in memory:
                local[0, 2 + kind_index] = memory[kind]
        for row, times in enumerate(steps[-self.window:], start=1):
            local[row, 0], local[row, 1] = times.step, times.start
            local[row, 2:] = torch.tensor([times.phases[p] for p in PHASES], dtype=torch.float64)
        if self.distributed:
            t0 = time.perf_counter()
            everyone = torch.empty((self.world * local.shape[0], columns), dtype=torch.float64, device=self.device)
            dist.all_gather_into_tensor(everyone, local.to(self.device))
            everyone = everyone.cpu().view(self.world, *local.shape)
            self.gather_seconds = time.perf_counter() - t0
        else:
            everyone = local[None]
        if self.rank != 0:
            return {}
        return {**self._phase_metrics(everyone), **self._memory_metrics(everyone[:, 0]),
                **self._stragglers(everyone[:, 1:])}

    def _phase_metrics(self, everyone: torch.Tensor) -> dict:
        metrics = {}
        steps = everyone[:, 1:]
        valid = ~torch.isnan(steps[:, :, 0])
        if not valid.any():
            return metrics
        # Each rank's mean seconds per step over the window, per phase and in total.
        phases = torch.nan_to_num(steps[:, :, 2:]) * valid[..., None]
        means = phases.sum(dim=1) / valid.sum(dim=1).clamp(min=1)[:, None]
        for index, name in enumerate((*PHASES, "total")):
            per_rank = (means.sum(dim=1) if name == "total" else means[:, index]).tolist()
            metrics.update(_spread(f"phase/{name}", per_rank, "slowest_rank", digits=6))
        return metrics

    def _memory_metrics(self, memory: torch.Tensor) -> dict:
        metrics = {}
        for index, kind in enumerate(self.memory_kinds):
            per_rank = memory[:, 2 + index]
            if not torch.isnan(per_rank).any():
                metrics.update(_spread(f"memory/{kind}", per_rank.tolist(), "max_rank", digits=4))
        return metrics

    def _stragglers(self, steps: torch.Tensor) -> dict:
        """Walk the window's steps that every rank finished, in order."""
        common = None
        for rank in range(self.world):
            ids = {int(s) for s in steps[rank, :, 0].tolist() if s == s}
            common = ids if common is None else common & ids
        worst = [0.0] * self.world  # each rank's largest lag over the window
        for step in sorted(common or ()):
            rows = torch.stack([steps[r][steps[r, :, 0] == step][0] for r in range(self.world)])
            worst = [max(a, b) for a, b in zip(worst, self.stragglers.check(step, rows[:, 1], rows[:, 2:]))]
        laggard = max(range(self.world), key=worst.__getitem__)
        return {"straggler/events": self.stragglers.events, "straggler/max_lag_s": round(worst[laggard], 6),
                "straggler/max_lag_rank": laggard}


class StragglerDetector:
    """Counts each rank's consecutive steps behind the median rank and names it once it reaches straggler_steps."""

    def __init__(self, cfg: Observability, hosts: list[str]):
        self.cfg = cfg
        self.hosts = hosts
        self.behind = [0] * len(hosts)
        self.events = 0
        self.named: list[tuple[int, str, int]] = []  # (rank, phase, step) of each straggler named

    def check(self, step: int, starts: torch.Tensor, phases: torch.Tensor) -> list[float]:
        """One step: ``starts`` (ranks,) unix seconds, ``phases`` (ranks, len(PHASES)) seconds; returns each rank's
        largest lag behind the median rank at a phase's end (0 for one never behind)."""
        lag = phase_end_lags(starts.tolist(), phases.tolist())
        median_step = statistics.median(phases.sum(dim=1).tolist())
        threshold = self.cfg.straggler_fraction * median_step
        lags = []
        for rank in range(len(self.hosts)):
            worst = lag_behind(lag[rank])
            lags.append(worst)
            if worst <= threshold:
                self.behind[rank] = 0
                continue
            self.behind[rank] += 1
            if self.behind[rank] == self.cfg.straggler_steps:
                self.events += 1
                growth = [later - earlier for earlier, later in zip(lag[rank], lag[rank][1:])]
                # Late from the start with no phase adding to it: the lag came from the end of the step before.
                phase = (PHASES[max(range(len(PHASES)), key=growth.__getitem__)] if max(growth) > 0
                         else "the previous step's last phases")
                self.named.append((rank, phase, step))
                first = step - self.cfg.straggler_steps + 1
                logger.warning(
                    f"straggler: rank {rank} (host {self.hosts[rank]}) fell behind in {phase} at steps {first}-{step}: "
                    f"{worst:.3f} s behind the median rank ({worst / max(median_step, 1e-9):.0%} of the median step "
                    f"of {median_step:.3f} s; observability.straggler_fraction = {self.cfg.straggler_fraction})")
        return lags


def _spread(prefix: str, per_rank: list[float], argmax_name: str, digits: int) -> dict:
    return {f"{prefix}/min": round(min(per_rank), digits),
            f"{prefix}/median": round(statistics.median(per_rank), digits),
            f"{prefix}/max": round(max(per_rank), digits),
            f"{prefix}/{argmax_name}": max(range(len(per_rank)), key=per_rank.__getitem__)}
