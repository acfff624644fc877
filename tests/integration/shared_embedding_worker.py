"""``torchtitan.train`` that also fingerprints, after every step, each copy of the token embedding a pipeline
keeps (the first stage's and the last stage's, pipeline_parallel.SharedEmbedding).

Run as a train_matrix job entry. Each rank writes ``{dump_folder}/embedding-rank{R}.json``: per step, the
SHA-256 of every copy it holds (the whole tensor) and whether that copy embeds the input (first stage).
"""

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config_check import load_and_validate
from torchtitan.log import init_logger
from torchtitan.train import Trainer


def main(argv: list[str]) -> int:
    cfg = load_and_validate(argv)
    init_logger(int(os.environ["RANK"]))
    trainer = Trainer(cfg)
    copies = [(part.embeds_input, part.tok_embeddings.weight) for part in trainer.model_parts
              if part.tok_embeddings is not None]
    steps = []
    train_step = trainer.train_step

    def fingerprinted_step(microbatches):
        result = train_step(microbatches)
        seen = []
        for first, weight in copies:
            whole = (weight.full_tensor() if isinstance(weight, DTensor) else weight).detach()
            seen.append({"first": first, "sha": hashlib.sha256(whole.float().cpu().numpy().tobytes()).hexdigest()})
        steps.append(seen)
        return result

    trainer.train_step = fingerprinted_step
    trainer.train()
    trainer.close()
    out = Path(cfg.job.dump_folder) / f"embedding-rank{dist.get_rank()}.json"
    out.write_text(json.dumps(steps))
    dist.barrier()
    return 0
