"""torch.profiler traces and CUDA memory snapshots, every profiling.profile_freq steps."""

import contextlib
import pickle
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from torchtitan.config.job_config import Profiling as ProfilingConfig
from torchtitan.log import logger

# Each cycle of profile_freq steps records its last step, after one warm-up step.
WARMUP_STEPS, ACTIVE_STEPS = 1, 1


class Profiler:
    """Call ``step()`` once per training step; traces land in {dump}/{save_traces_folder}/iteration_N/."""

    def __init__(self, cfg: ProfilingConfig, dump_folder: str, rank: int, device: torch.device):
        self.rank = rank
        self.trace_folder = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_folder = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.freq = cfg.profile_freq
        self.torch_profiler = None
        self.snapshots = False
        if cfg.enable_profiling:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            wait = max(self.freq - WARMUP_STEPS - ACTIVE_STEPS, 0)
            self.torch_profiler = profile(
                activities=activities,
                schedule=schedule(wait=wait, warmup=WARMUP_STEPS, active=ACTIVE_STEPS),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            # Each trace holding only its own cycle is what we want; torch warns about it anyway.
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
            self.torch_profiler.start()
        if cfg.enable_memory_snapshot:
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                self.snapshots = True
            else:
                logger.warning(f"memory snapshots need a CUDA device; none are recorded on '{device.type}'")

    def _save_trace(self, prof) -> None:
        folder = self.trace_folder / f"iteration_{prof.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        logger.info(f"profiler trace written to {path} (open in Perfetto or TensorBoard)")

    def step(self, step: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.snapshots and step % self.freq == 0:
            folder = self.snapshot_folder / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def close(self) -> None:
        if self.torch_profiler is not None:
            with contextlib.suppress(RuntimeError):  # stopping between cycles has nothing to flush
                self.torch_profiler.stop()
            self.torch_profiler = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshots = False
