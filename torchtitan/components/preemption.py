"""Graceful stop on SIGTERM or SIGUSR1 (Slurm's preemption and time-limit notices).

The handler only records the signal. After each step all ranks agree (one tiny all-reduce) on whether
any of them was signalled, so they stop at the same step, save a checkpoint and exit cleanly; a
resubmitted job then resumes from it.

A signal is held only where stopping at the end of a step can still be worth waiting for. It gets the disposition
it had before the watcher (by default: the process ends) when
- it comes before this process finished a step (no `should_stop` call yet): there is nothing new to save, and the
  first step may never come (a data loader that yields nothing, a rendezvous that never completes);
- it comes again ``repeat_after_s`` or more after it was first held: the run is not reaching the end of its step,
  or the sender will not wait. A repeat sooner than that is the same notice delivered twice: Slurm signals every
  process of a job and torchrun forwards the signal to its workers again.
"""

import signal
import time

import torch
import torch.distributed as dist

from torchtitan.log import logger
from torchtitan.stop_signals import STOP_SIGNALS


class PreemptionWatcher:
    def __init__(self, device: torch.device, repeat_after_s: float = 10.0):
        self.device = device
        self.repeat_after_s = repeat_after_s
        self.received: str | None = None
        self._held: dict[int, float] = {}  # signal -> when it was first held (time.monotonic)
        self._stepped = False
        self.previous = {sig: signal.signal(sig, self._record) for sig in STOP_SIGNALS}

    def _record(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if signum in self._held and now - self._held[signum] < self.repeat_after_s:
            return  # the same notice again
        if not self._stepped or signum in self._held:
            self.close()
            previous = self.previous[signum]
            if callable(previous):
                previous(signum, frame)
            else:  # sent again under the previous disposition; by default the process ends here
                signal.raise_signal(signum)
            return
        self._held[signum] = now
        self.received = self.received or name
        logger.warning(f"received {name}: stopping after the current step; send it again in "
                       f"{self.repeat_after_s:g} s or later to stop at once")

    def should_stop(self) -> bool:
        """True on every rank once any rank has been signalled. Called after each step."""
        self._stepped = True
        flag = torch.tensor(1.0 if self.received else 0.0, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, handler in self.previous.items():
            # None: a handler not set from Python, i.e. the default one.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
