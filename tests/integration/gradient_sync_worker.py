"""``torchtitan.train`` that also counts the gradient all-reduces across data-parallel replicas.

Run by test_gradient_sync.py as the entry of a train_matrix job. Each rank writes
``{dump_folder}/all_reduces-rank{R}.json`` with the FSDP2 / replicate units that hold parameters and the
all-reduces their hooks saw.
"""

import json
import os
from pathlib import Path

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from torchtitan.config_check import load_and_validate
from torchtitan.log import init_logger
from torchtitan.train import Trainer


def main(argv: list[str]) -> int:
    cfg = load_and_validate(argv)
    init_logger(int(os.environ["RANK"]))
    trainer = Trainer(cfg)
    # One unit per FSDP state: a unit made of several modules (norm + output) shares one state.
    units = list({id(m._get_fsdp_state()): m for part in trainer.model_parts for m in part.modules()
                  if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups}.values())
    calls = []
    for unit in units:
        # Called after each all-reduce of the unit's gradients over the replicas (never for plain FSDP here).
        unit.set_all_reduce_hook(lambda reduced: calls.append(1))
    trainer.train()
    trainer.close()
    out = Path(cfg.job.dump_folder) / f"all_reduces-rank{dist.get_rank()}.json"
    out.write_text(json.dumps({"units": len(units), "all_reduces": len(calls), "steps": trainer.step,
                               "accumulation": trainer.grad_accum_steps}))
    dist.barrier()
    return 0
