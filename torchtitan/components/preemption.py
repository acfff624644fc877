"""Graceful stop on SIGTERM or SIGUSR1 (Slurm's preemption and time-limit notices).

The handler only records the signal. After each step all ranks agree (one tiny all-reduce) on whether
any of them was signalled, so they stop at the same step, save a checkpoint and exit cleanly; a
resubmitted job then resumes from it.
"""

import signal

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    def __init__(self, device: torch.device):
        self.device = device
        self.received: str | None = None
        self.previous = {sig: signal.signal(sig, self._record) for sig in PREEMPTION_SIGNALS}

    def _record(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """True on every rank once any rank has been signalled."""
        flag = torch.tensor(1.0 if self.received else 0.0, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def ignore_preemption_signals(worker_id: int | None = None) -> None:
    """For dataloader workers: the training process decides when to stop, the workers must not die first."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
