"""Multi-token prediction (MTP) in training: what each depth predicts, and its loss.

The main model predicts, at position i, labels[i] (the token after input_ids[i]). MTP block k (k = 1..depth)
predicts the token k places further, labels[i + k], from the previous depth's hidden state at i and the
embedding of input_ids[i + k] (models/deepseek_v3/model.py). Its targets are made here from the whole rows,
before context parallelism shards them like the tokens: a row's last k positions have nothing to predict and
are ignored, as are targets in another document when documents are kept apart (block-causal attention), and
targets whose own label is ignored (a fine-tuning loss mask applies to every depth alike).

The trained loss is main + weight x (mean over depths of each depth's mean cross-entropy), each mean taken over
that depth's valid targets in the whole step, as the main loss is (components/objectives/loss.py).
"""


import torch

from torchtitan.components.objectives.loss import LossFn, count_valid_tokens
from torchtitan.config.job_config import Checkpoint, Model, Training
from torchtitan.data.dataset import IGNORE_INDEX, Batch
from torchtitan.protocols.model import BaseModelArgs

DEFAULT_LOSS_WEIGHT = Training.mtp_loss_weight


def config_problems(model: Model, training: Training, checkpoint: Checkpoint,
                    args: BaseModelArgs) -> list[tuple[str, str]]:
    """(full key, reason) for multi-token prediction as configured; ``args`` are the run's model args."""
    depth = args.mtp_depth
    # The key to name: model.mtp_depth when set, else the flavor whose depth it is.
    key, what = ("model.mtp_depth", "") if model.mtp_depth is not None else ("model.flavor", f"(mtp_depth {depth}) ")
    if depth == 0 and checkpoint.hf_include_mtp:
        return [("checkpoint.hf_include_mtp", "exports multi-token prediction blocks, but this model has none; "
                                              "set model.mtp_depth or leave it false")]
    if not training.mtp_loss_weight >= 0:  # (NaN too)
        return [("training.mtp_loss_weight", "is invalid; it must be >= 0")]
    if depth == 0 and training.mtp_loss_weight != DEFAULT_LOSS_WEIGHT:
        return [("training.mtp_loss_weight", "weighs a multi-token prediction loss, but this model trains none "
                                             "(model.mtp_depth, deepseek_v3 only); leave the weight unset")]
    if depth >= training.seq_len:
        return [(key, f"{what}leaves nothing to predict in training.seq_len = {training.seq_len}")]
    return []


def mtp_targets(batch: Batch, depth: int, block_causal: bool) -> dict[str, torch.Tensor]:
    """The model's ``mtp_tokens`` and ``mtp_labels``, each (batch, depth, seq_len): at [:, k - 1, i] the input
    token input_ids[i + k] and its label labels[i + k], IGNORE_INDEX where there is none (the token there is
    then 0: nothing it produces is trained)."""
    tokens, labels, documents = batch.input_ids, batch.labels, batch.document_ids
    seq_len = tokens.shape[1]
    if depth >= seq_len:
        raise ValueError(f"multi-token prediction depth {depth} leaves nothing to predict in rows of {seq_len} tokens")
    mtp_tokens, mtp_labels = [], []
    for k in range(1, depth + 1):
        ahead = labels[:, k:]
        if block_causal:
            ahead = ahead.masked_fill(documents[:, k:] != documents[:, :-k], IGNORE_INDEX)
        mtp_tokens.append(torch.nn.functional.pad(tokens[:, k:], (0, k), value=0))
        mtp_labels.append(torch.nn.functional.pad(ahead, (0, k), value=IGNORE_INDEX))
    return {"mtp_tokens": torch.stack(mtp_tokens, dim=1), "mtp_labels": torch.stack(mtp_labels, dim=1)}


def count_mtp_targets(mtp_labels: torch.Tensor) -> torch.Tensor:
    """Valid targets per depth, (depth,)."""
    return torch.stack([count_valid_tokens(mtp_labels[:, k]) for k in range(mtp_labels.shape[1])])


def mtp_loss(loss_fn: LossFn, predictions: list[torch.Tensor], mtp_labels: torch.Tensor,
             global_targets: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the mean over depths of each depth's global mean cross-entropy;
    ``global_targets`` (depth,) counts each depth's valid targets over the step and every rank."""
    shares = [loss_fn(out, mtp_labels[:, k], global_targets[k]) for k, out in enumerate(predictions)]
    return sum(shares) / len(shares)
