"""Train-matrix entries (tests/integration/parity.py) that check document masking inside a real Trainer.

``independence``: two documents packed in one row under the layout the flags give; writes the largest
changes of document B's logits when every token of A changes and against B run alone, and the largest
gradient of a loss on B's tokens on the embedding rows only A uses.
``loss_normalisation``: a loss over two micro-batches whose trained-token counts differ 10x, against the
same rows in one micro-batch (one process) or split over the data-parallel ranks; writes loss and
gradients. Both write ``{dump_folder}/result-rank{R}.pt`` and an empty metrics.jsonl for train_matrix.
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config_check import load_and_validate
from torchtitan.data import Batch, document_positions
from torchtitan.data.dataset import IGNORE_INDEX
from torchtitan.distributed.context_parallel import unshard_sequence
from torchtitan.log import init_logger
from torchtitan.train import Trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(tokens: torch.Tensor, document_ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    return Batch(tokens, labels, document_ids, document_positions(document_ids))


def _logits(trainer: Trainer, batch: Batch) -> torch.Tensor | None:
    """Full (batch, seq, vocab) logits on the ranks that compute the output, else None."""
    tokens, inputs, labels = trainer._sharded_inputs(trainer._on_device(batch), batch.labels.to(trainer.device))
    with torch.no_grad(), trainer.autocast():
        if trainer.pipeline is None:
            out = trainer.model_parts[0](tokens, **inputs)
        else:
            pipe = trainer.pipeline
            out = pipe.schedule.eval(*((tokens,) if pipe.has_first_stage else ()),
                                     target=labels if pipe.has_last_stage else None,
                                     losses=[] if pipe.has_last_stage else None, **inputs)
            if not pipe.has_last_stage:
                return None
    out = _full(out).float()
    if trainer.parallel_dims.cp_enabled:
        mesh = trainer.parallel_dims.submesh("cp")
        shards = [torch.empty_like(out) for _ in range(mesh.size())]
        dist.all_gather(shards, out.contiguous(), group=mesh.get_group())
        out = unshard_sequence(shards, dim=1)
    return out.cpu()


def _embedding_grad(trainer: Trainer) -> torch.Tensor | None:
    for part in trainer.model_parts:
        if part.tok_embeddings is not None:
            return _full(part.tok_embeddings.weight.grad).float().cpu()
    return None


def _start(argv: list[str]) -> Trainer:
    cfg = load_and_validate(argv)
    init_logger(int(os.environ.get("RANK", "0")))
    return Trainer(cfg)


def _finish(trainer: Trainer, result: dict) -> int:
    folder = Path(trainer.cfg.job.dump_folder)
    torch.save(result, folder / f"result-rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        (folder / "metrics.jsonl").write_text("")
    trainer.close()
    dist.barrier()
    return 0


def independence(argv: list[str]) -> int:
    trainer = _start(argv)
    rows, seq = trainer.cfg.training.local_batch_size, trainer.cfg.training.seq_len
    vocab = trainer.model_args.vocab_size
    g = torch.Generator().manual_seed(5)
    # A crosses every context-parallel chunk boundary up to 40% of the row; B fills the rest. They use
    # disjoint token ranges, so embedding rows that only A uses are A's input embeddings.
    a_len, half = seq * 2 // 5 + 1, vocab // 2
    a = torch.randint(3, half, (rows, a_len), generator=g)
    a_changed = torch.randint(3, half, (rows, a_len), generator=g)
    b = torch.randint(half, vocab, (rows, seq - a_len), generator=g)
    ids = torch.cat([torch.zeros(rows, a_len), torch.ones(rows, seq - a_len)], dim=1).long()
    # B alone: B from position 0, followed by a document of A's tokens that B cannot see.
    alone_ids = torch.cat([torch.zeros(rows, seq - a_len), torch.ones(rows, a_len)], dim=1).long()
    ignored = torch.full((rows, seq), IGNORE_INDEX)
    b_labels = ignored.clone()
    b_labels[:, a_len:-1] = b[:, 1:]
    packed = _batch(torch.cat([a, b], 1), ids, b_labels)
    logits = _logits(trainer, packed)
    changed = _logits(trainer, _batch(torch.cat([a_changed, b], 1), ids, ignored))
    alone = _logits(trainer, _batch(torch.cat([b, a], 1), alone_ids, ignored))
    result = {}
    if logits is not None:
        result["changed_a"] = (logits[:, a_len:] - changed[:, a_len:]).abs().max().item()
        result["a_logits_moved"] = (logits[:, :a_len] - changed[:, :a_len]).abs().max().item()
        result["vs_alone"] = (logits[:, a_len:] - alone[:, : seq - a_len]).abs().max().item()
        result["largest_logit"] = logits.abs().max().item()
    trainer.train_step([packed])
    grad = _embedding_grad(trainer)
    if grad is not None:
        result["a_embedding_grad"] = grad[a.unique()].abs().max().item()
        result["b_embedding_grad"] = grad[b.unique()].abs().max().item()
    return _finish(trainer, result)


def loss_normalisation(argv: list[str]) -> int:
    trainer = _start(argv)
    seq, vocab = trainer.cfg.training.seq_len, trainer.model_args.vocab_size
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(3, vocab, (4, seq), generator=g)
    labels = torch.full((4, seq), IGNORE_INDEX)
    # Rows 0-1 train 40 tokens, rows 2-3 train 4: the two micro-batches' counts differ 10x.
    for row, count in ((0, 20), (1, 20), (2, 2), (3, 2)):
        where = torch.randperm(seq, generator=g)[:count]
        labels[row, where] = torch.randint(3, vocab, (count,), generator=g)
    ids = torch.zeros(4, seq, dtype=torch.long)
    whole = _batch(tokens, ids, labels)
    first, second = (Batch(*(t[rows] for t in whole)) for rows in (slice(0, 2), slice(2, 4)))
    params = [p for part in trainer.model_parts for p in part.parameters()]
    saved = [p.detach().clone() for p in params]

    def step(microbatches):
        loss, _ = trainer.train_step(microbatches)
        grads = {name: _full(p.grad).float().cpu().clone() for part in trainer.model_parts
                 for name, p in part.named_parameters()}
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        return loss.item(), grads

    dp_rank, dp = trainer.parallel_dims.dp_coordinates()
    if dp == 1:
        result = {"two_microbatches": step([first, second]), "one_microbatch": step([whole])}
    else:
        result = {"data_parallel": step([(first, second)[dp_rank]])}
    return _finish(trainer, result)
