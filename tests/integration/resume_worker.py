"""``torchtitan.train`` resumed from another run's checkpoint: a train_matrix job entry.

Its argv holds ``--resume-from=FOLDER/checkpoint/step-N`` (taken out before the trainer sees it): rank 0 copies
that checkpoint into this job's dump folder, the other ranks wait for the copy, and the trainer resumes from it.
"""

import os
import shutil
import time
from pathlib import Path

from torchtitan.train import main as train


def main(argv: list[str]) -> int:
    (source,) = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--resume-from=")]
    (dump,) = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--job.dump_folder=")]
    target = Path(dump) / "checkpoint" / Path(source).name
    copied = Path(dump) / "copied"
    if os.environ.get("RANK", "0") == "0":
        shutil.copytree(source, target)
        copied.touch()
    while not copied.exists():
        time.sleep(0.05)
    return train([arg for arg in argv if not arg.startswith("--resume-from=")])
