"""``torchtitan.train`` with the instruments of test_fault_tolerance.py, set from the environment.

Every rank appends to ``{dump_folder}/weights-rank{R}.jsonl`` (the group's own folder), after each committed
step: the step, the SHA-256 of its local weight shards and the groups that took part.
``FT_SLOW_WHEN_ALONE=s``: sleep s seconds after each step taken by fewer groups than group_size, so that the
surviving group is still training when a relaunched one comes back.
``FT_PAUSE_AFTER_STEP=k``: once a step >= k is committed, each rank writes ``{dump_folder}/paused-rank{R}`` (after
its weights row) and waits to be killed. ``FT_PAUSE_BEFORE_STEP=k``: the same before step k starts (so after step
k - 1's checkpoint is saved).
``FT_START_TOGETHER=folder``: before the first step, mark this group ready there and wait until every group is,
so that the lighthouse sees them all (it waits for the groups it hears from) and the first quorum has them all.
"""

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from torchtitan import train

_train_step = train.Trainer.train_step
# torchft's own account of quorums and recoveries, for a failing test's output.
_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("%(asctime)s torchft %(message)s"))
for _name in ("torchft.manager", "torchft.checkpointing.http_transport"):
    logging.getLogger(_name).setLevel(logging.INFO)
    logging.getLogger(_name).addHandler(_handler)


def pause(self) -> None:
    (Path(self.cfg.job.dump_folder) / f"paused-rank{self.rank}").touch()
    time.sleep(3600)


def instrumented_step(self, microbatches):
    if self.step + 1 == int(os.environ.get("FT_PAUSE_BEFORE_STEP", "0")):
        pause(self)
    result = _train_step(self, microbatches)
    if not self.replicas.committed:
        return result
    step = self.step + 1
    digest = hashlib.sha256()
    for part in self.model_parts:
        for _, p in part.named_parameters():
            local = (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
            digest.update(local.view(torch.uint8).numpy().tobytes())
    groups = self.replicas.manager.num_participants()
    folder = Path(self.cfg.job.dump_folder)
    with open(folder / f"weights-rank{self.rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "sha": digest.hexdigest(), "groups": groups}) + "\n")
    if step >= int(os.environ.get("FT_PAUSE_AFTER_STEP", "0")) > 0:
        pause(self)
    if groups < self.cfg.fault_tolerance.group_size:
        time.sleep(float(os.environ.get("FT_SLOW_WHEN_ALONE", "0")))
    return result


_train = train.Trainer.train


def train_together(self):
    if folder := os.environ.get("FT_START_TOGETHER"):
        ft = self.cfg.fault_tolerance
        (Path(folder) / f"ready-{ft.replica_id}").touch()
        while not all((Path(folder) / f"ready-{r}").exists() for r in range(ft.group_size)):
            time.sleep(0.05)
    return _train(self)


train.Trainer.train_step = instrumented_step
train.Trainer.train = train_together

if __name__ == "__main__":
    sys.exit(train.main())
