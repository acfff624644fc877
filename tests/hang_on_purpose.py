"""Test-only (experimental.custom_import): rank HANG_RANK of a training run hangs on purpose when it asks for
step HANG_STEP's batch, so the hang watchdog has something to report (tests/integration/test_hang_watchdog.py).

The other ranks go on into the step and wait in its first collective. When $HANG_STAMP is set, the hung rank
writes the unix time the hang began to that file.
"""

import os
import time

from torchtitan.data.dataloader import TokenDataLoader

HANG_RANK = 1
HANG_STEP = 3  # counted in micro-batches: one per step without gradient accumulation


def sleep_forever_on_purpose() -> None:
    while True:
        time.sleep(3600)  # THE HANG


def _hanging(batches):
    for index, batch in enumerate(batches, start=1):
        if index == HANG_STEP and int(os.environ.get("RANK", "0")) == HANG_RANK:
            if stamp := os.environ.get("HANG_STAMP"):
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
            sleep_forever_on_purpose()
        yield batch


_iter = TokenDataLoader.__iter__
if not getattr(_iter, "hangs_on_purpose", False):  # imported twice: patch once
    def _hanging_iter(self):
        return _hanging(_iter(self))

    _hanging_iter.hangs_on_purpose = True
    TokenDataLoader.__iter__ = _hanging_iter
