"""``torchtitan.train`` of a QLoRA run that also records, per rank, what its NF4 base holds there.

Run as a train_matrix job entry. Each rank writes ``{dump_folder}/nf4-rank{R}.json``: the bytes of the NF4 weights'
codes and scales on this rank, and how many of those weights FSDP shards.
"""

import json
import os
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config_check import load_and_validate
from torchtitan.log import init_logger
from torchtitan.models.shared.nf4 import is_nf4, nf4_bytes
from torchtitan.train import Trainer


def main(argv: list[str]) -> int:
    cfg = load_and_validate(argv)
    rank = int(os.environ.get("RANK", "0"))
    init_logger(rank)
    trainer = Trainer(cfg)
    local = [p.to_local() if isinstance(p, DTensor) else p for part in trainer.model_parts for p in part.parameters()]
    nf4 = [t for t in local if is_nf4(t)]
    sharded = sum(isinstance(p, DTensor) and is_nf4(p.to_local()) for part in trainer.model_parts
                  for p in part.parameters())
    record = {"bytes": sum(nf4_bytes(t) for t in nf4), "weights": len(nf4), "sharded": sharded}
    trainer.train()
    trainer.close()
    (Path(cfg.job.dump_folder) / f"nf4-rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
    return 0
