"""The bad-step guard (training.guard): skip the optimizer step when the step's gradients cannot be trusted.

A step is skipped when its global gradient norm or loss is not finite, or when its loss exceeds ``spike_factor``
times the median loss of the last ``window`` kept steps (looked for once the window is full). Every rank takes
the same decision: the loss and the norm are already global. A skipped step has consumed its batch and the LR
schedule still advances, but the weights, the optimizer state and the MoE routing biases are left as they were
(the trainer does not call the optimizer, the converters' post-step hook or the balancer's update). After more
than ``max_consecutive`` skipped steps in a row the run stops: something other than an outlier batch is wrong.

The running window and the counters are checkpointed (key ``guard``), so a resumed run decides exactly as the
uninterrupted one would. Deciding needs the loss and norm on the host: one device synchronisation per step,
paid only with the guard on.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config.job_config import Guard as GuardConfig


def config_problems(cfg: GuardConfig) -> list[tuple[str, str]]:
    """Problems with the [training.guard] section as (field, reason) pairs."""
    problems = []
    if not (cfg.spike_factor == 0 or cfg.spike_factor > 1) or not math.isfinite(cfg.spike_factor):
        problems.append(("spike_factor", "is invalid; it must be > 1 (or 0: no spike check)"))
    if cfg.window < 1:
        problems.append(("window", "is invalid; it must be >= 1"))
    if cfg.max_consecutive < 0:
        problems.append(("max_consecutive", "is invalid; it must be >= 0"))
    return problems


class StepGuard(Stateful):
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)  # the losses of the last kept steps
        self.consecutive = 0  # skipped steps in a row, up to now
        self.skipped = 0  # skipped steps since the run began
        self.last_reason: str | None = None  # why the latest step was skipped; None when it was kept
        self._stored_window: int | None = None

    def check(self, loss: float, grad_norm: float) -> str | None:
        """Decide on a step from its global loss and gradient norm: the reason to skip it, or None to keep it."""
        reason = None
        if not math.isfinite(grad_norm) or not math.isfinite(loss):
            reason = f"loss {loss:.4f}, grad_norm {grad_norm:.4f}: not finite"
        elif self.cfg.spike_factor > 0 and len(self.losses) == self.cfg.window:
            median = statistics.median(self.losses)
            if loss > self.cfg.spike_factor * median:
                reason = (f"loss {loss:.4f} > {self.cfg.spike_factor:g} x the median {median:.4f} of the last "
                          f"{self.cfg.window} kept steps")
        if reason is None:
            self.losses.append(loss)
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.skipped += 1
        self.last_reason = reason
        return reason

    def stop_reason(self) -> str | None:
        """Why the run must stop (too many skipped steps in a row), else None."""
        if self.consecutive <= self.cfg.max_consecutive:
            return None
        return (f"{self.consecutive} steps in a row were skipped by the bad-step guard (more than "
                f"training.guard.max_consecutive = {self.cfg.max_consecutive}; the last: {self.last_reason}); lower "
                "the learning rate, check the data, or resume from an earlier checkpoint")

    def metrics(self) -> dict[str, int]:
        return {"guard/skipped_steps": self.skipped} if self.cfg.enable else {}

    # The window is stored as a float64 tensor of the losses it holds; a checkpoint's window may be of another
    # length than this run's (a changed training.guard.window), so loading sizes the destination from it first.
    def prepare_load(self, metadata) -> None:
        entry = metadata.state_dict_metadata.get("guard.losses")
        self._stored_window = None if entry is None else int(entry.size[0])

    def state_dict(self) -> dict:
        if self._stored_window is not None:
            losses = torch.zeros(self._stored_window, dtype=torch.float64)
        else:
            losses = torch.tensor(list(self.losses), dtype=torch.float64)
        return {"losses": losses, "counts": torch.tensor([self.consecutive, self.skipped], dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        self._stored_window = None
        self.losses = deque(state["losses"].tolist(), maxlen=self.cfg.window)
        self.consecutive, self.skipped = (int(x) for x in state["counts"].tolist())
