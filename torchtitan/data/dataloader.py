"""Builds the stateful dataloader that feeds (input_ids, labels) batches to training."""

from __future__ import annotations

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.data.dataset import PackedTokenDataset, load_documents
from torchtitan.data.tokenizer import Tokenizer


def build_dataloader(
    tokenizer: Tokenizer,
    *,
    dataset: str,
    dataset_path: str | None,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    split: str = "train",
    infinite: bool = True,
) -> StatefulDataLoader:
    """Return a resumable loader of (input_ids, labels) batches, each [local_batch_size, seq_len]."""
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if num_workers > 1:
        raise ValueError(
            f"num_workers={num_workers} is not supported: use 0 or 1 "
            "(every worker would have to tokenize the whole stream)"
        )
    packed = PackedTokenDataset(
        load_documents(dataset, dataset_path, split),
        tokenizer,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that torch now deprecates; the warning is not ours to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            packed,
            batch_size=local_batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
        )
