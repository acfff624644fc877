"""``torchtitan.train`` with optimizer.name = "Muon" that also counts, per rank, the matrices it orthogonalises.

Run as a train_matrix job entry. Each rank writes ``{dump_folder}/muon-rank{R}.json``: the optimizer steps taken,
the matrices that went through Newton-Schulz on this rank in all (a stack of experts counts each expert), and the
names of the matrices this rank owns (all of them when no Muon matrix is a DTensor).
"""

import json
import os
from pathlib import Path

import torch.distributed as dist

from torchtitan.components.optimizers import muon
from torchtitan.config_check import load_and_validate
from torchtitan.log import init_logger
from torchtitan.train import Trainer


def main(argv: list[str]) -> int:
    cfg = load_and_validate(argv)
    rank = int(os.environ.get("RANK", "0"))
    init_logger(rank)
    trainer = Trainer(cfg)
    optimizer = trainer.optimizer
    assert isinstance(optimizer, muon.MuonWithAdamW), type(optimizer)
    counts = {"steps": 0, "matrices": 0}
    newton_schulz, step = muon.newton_schulz, optimizer.step

    def counted_newton_schulz(update, *args):
        counts["matrices"] += update.shape[0] if update.ndim == 3 else 1
        return newton_schulz(update, *args)

    def counted_step(*args, **kwargs):
        counts["steps"] += 1
        return step(*args, **kwargs)

    muon.newton_schulz, optimizer.step = counted_newton_schulz, counted_step
    try:
        trainer.train()
    finally:
        muon.newton_schulz = newton_schulz
    trainer.close()
    plan = optimizer.whole_matrices
    if plan is None:
        named = muon.split_parameters(trainer.model_parts)[0]
        owned = [name if p.ndim == 2 else f"{name}[{e}]" for name, p in named
                 for e in range(1 if p.ndim == 2 else p.shape[0])]
    else:
        owned = [matrix.name for matrix in plan.owned]
    (Path(cfg.job.dump_folder) / f"muon-rank{rank}.json").write_text(json.dumps({**counts, "owned": owned}))
    if dist.is_initialized():
        dist.barrier()
    return 0
