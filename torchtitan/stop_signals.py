"""The signals a scheduler sends before it ends a job: SIGTERM (Slurm's preemption and time-limit notice) and
SIGUSR1 (``sbatch --signal``). The trainer's watcher turns them into a stop at a step boundary
(components/preemption.py); dataloader workers ignore them, since the training process decides when to stop
and the workers must not die first."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A dataloader's ``worker_init_fn``."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
