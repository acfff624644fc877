"""What the trainer needs from a model family, beyond being an nn.Module."""

import dataclasses
from typing import ClassVar, Protocol, Self

import torch
from torch import nn


@dataclasses.dataclass
class BaseModelArgs:
    """Hyper-parameters of one model flavor.

    A family subclasses this with its own fields; the trainer relies only on the fields and methods below
    (models/shared/decoder_args.py adds the shared decoder's, which parallelism and the planner read).
    """

    # Keyword-only, so a family's own fields may come without defaults.
    vocab_size: int | None = dataclasses.field(default=None, kw_only=True)
    """Rows of the embedding table; None: the tokenizer's, set by finalize()."""
    mtp_depth: int = dataclasses.field(default=0, kw_only=True)
    """Multi-token prediction blocks after the main ones (block k predicts the token k + 1 places ahead);
    only where the family's model builds them (``builds_mtp_blocks``)."""

    builds_mtp_blocks: ClassVar[bool] = False
    """Whether the family's model builds ``mtp_depth`` multi-token prediction blocks (model.mtp_depth)."""

    def finalize(self, tokenizer_vocab_size: int, seq_len: int) -> Self:
        """The args to build with, once the tokenizer and sequence length are known."""
        return self

    def with_mup(self, base_width: int, base_head_dim: int) -> Self:
        """These args parametrized by µP relative to a base model (model.mup; base_head_dim 0: this model's head
        size); ValueError where the family has no µP."""
        raise ValueError(f"model {type(self).__name__} has no µP parametrization")

    def check(self) -> list[tuple[str, str]]:
        """Problems with these args as (field, reason) pairs; empty when the args are usable."""
        return []

    def check_tensor_parallel(self, tp: int) -> list[tuple[str, str]]:
        """Problems splitting this model over ``tp`` tensor-parallel ranks, as (field, reason) pairs."""
        return []

    def flops_per_token(self, num_params_without_embedding: int, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token."""
        return 6.0 * num_params_without_embedding


class TrainableModel(Protocol):
    """A model the trainer can build on the meta device and then initialise for real."""

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer, identically for any parallel layout."""


def token_flop_params(model: nn.Module) -> int:
    """The parameters a token's training FLOPs count: all but embedding tables and a vision tower (``visual``),
    which runs per image patch, not per token."""
    tower = getattr(model, "visual", None)
    in_tower = sum(p.numel() for p in tower.parameters()) if tower is not None else 0
    tower_tables = sum(m.weight.numel() for m in tower.modules() if isinstance(m, nn.Embedding)) if tower else 0
    return count_params(model, exclude_embedding=True) - in_tower + tower_tables


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameter count (global, not per shard); embedding tables are nn.Embedding weights."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        total -= sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    return total
