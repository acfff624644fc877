"""``torchtitan.train`` of a QLoRA run that also records, per rank, what its NF4 base holds there.

Run as a train_matrix job entry. Each rank writes ``{dump_folder}/nf4-rank{R}.json``: the bytes of the NF4 weights'
codes and scales on this rank, the bytes of all its parameters, how many NF4 weights FSDP shards, and per NF4
weight the SHA-256 of its dequantised values here cut into 1, 2 and 4 slices of rows (a shard of a sharded layout
must be the single process's slice, bit for bit: quantised whole, never per shard).
"""

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config_check import load_and_validate
from torchtitan.log import init_logger
from torchtitan.models.shared.nf4 import is_nf4, nf4_bytes
from torchtitan.models.shared.seeded_init import canonical_name
from torchtitan.train import Trainer


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def main(argv: list[str]) -> int:
    cfg = load_and_validate(argv)
    rank = int(os.environ.get("RANK", "0"))
    init_logger(rank)
    trainer = Trainer(cfg)
    local = {canonical_name(name): (p.to_local() if isinstance(p, DTensor) else p, isinstance(p, DTensor))
             for part in trainer.model_parts for name, p in part.named_parameters()}
    nf4 = {name: t for name, (t, _) in local.items() if is_nf4(t)}
    record = {
        "bytes": sum(nf4_bytes(t) for t in nf4.values()),
        "param_bytes": sum(nf4_bytes(t) if is_nf4(t) else t.numel() * t.element_size() for t, _ in local.values()),
        "weights": len(nf4),
        "sharded": sum(sharded for name, (_, sharded) in local.items() if name in nf4),
        "values": {name: {k: [_sha(s) for s in t.get_original_weight().chunk(k)] for k in (1, 2, 4)}
                   for name, t in nf4.items()},
    }
    trainer.train()
    trainer.close()
    (Path(cfg.job.dump_folder) / f"nf4-rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
    return 0
