"""``python -m torchtitan.train`` whose checkpoint writes sleep 3 s first, so a test can kill a run mid-save."""

import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

from torchtitan.train import main

SECONDS = 3.0
_write_data = FileSystemWriter.write_data


def _slow_write_data(self, plan, planner):
    time.sleep(SECONDS)
    return _write_data(self, plan, planner)


if __name__ == "__main__":
    FileSystemWriter.write_data = _slow_write_data
    sys.exit(main())
