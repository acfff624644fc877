"""The trainer with one rank's data late on purpose (a slow disk, a slow preprocessing worker): rank 1 waits
SECONDS before each batch of STEPS, and rank 0's log also goes to {job.dump_folder}/train.log, so that the
straggler test can read what was named. A matrix entry (tests/integration/parity.py): ``main(argv)``."""

import logging
import time
from pathlib import Path

from torchtitan import train
from torchtitan.log import logger

SLOW_RANK, STEPS, SECONDS = 1, range(4, 9), 0.5


class _LateData:
    """The trainer's data loader, unchanged but for the wait."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for index, batch in enumerate(self.loader, start=1):  # one batch per step here (no accumulation)
            if index in STEPS:
                time.sleep(SECONDS)
            yield batch


def main(argv: list[str]) -> int:
    dump = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("--job.dump_folder=")))
    original_init, original_logger = train.Trainer.__init__, train.init_logger

    def init(self, cfg):
        original_init(self, cfg)
        if self.rank == SLOW_RANK:
            self.dataloader = _LateData(self.dataloader)

    def init_logger(rank, all_ranks=False):
        original_logger(rank, all_ranks)
        if rank == 0:
            dump.mkdir(parents=True, exist_ok=True)
            logger.addHandler(logging.FileHandler(dump / "train.log"))

    train.Trainer.__init__, train.init_logger = init, init_logger
    try:
        return train.main(argv)
    finally:
        train.Trainer.__init__, train.init_logger = original_init, original_logger
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            handler.close()
            logger.removeHandler(handler)
