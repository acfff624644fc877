"""Which document boundaries the model sees: block-causal attention and per-document RoPE positions.

Every batch carries each token's document id and position within its document (data/dataset.py); the
config decides which of them reach the model. ``auto`` means: conversations (chat data) and RL's rollouts
(training.objective = "grpo", each sampled on its own) are kept apart, so a packed sequence never sees another
and starts at position 0, and pretraining text keeps the plain causal mask over the packed row with positions
0..seq_len-1.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from torchtitan.config.job_config import Model, Training, Validation
from torchtitan.data.dataset import Batch


@dataclass(frozen=True)
class DocumentMasking:
    """What the model's forward receives beyond the tokens: document ids (block-causal attention), per-document
    positions, and the labels when the output head computes the loss itself (training.loss_chunk_size)."""

    block_causal: bool
    per_document_positions: bool
    labels: bool = False

    @classmethod
    def from_config(cls, model: Model, training: Training) -> DocumentMasking:
        chat = training.dataset_format == "chat" or training.objective == "grpo"
        mask = model.attention_mask if model.attention_mask != "auto" else ("block_causal" if chat else "causal")
        positions = model.positions if model.positions != "auto" else ("per_document" if chat else "global")
        return cls(block_causal=mask == "block_causal", per_document_positions=positions == "per_document",
                   labels=training.loss_chunk_size > 0)

    def model_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward beyond the tokens that go token by token (context
        parallelism splits them with the tokens). A batch with images always gives its M-RoPE positions."""
        images = getattr(batch, "per_token", dict)()
        inputs = {}
        if self.block_causal:
            inputs["document_ids"] = batch.document_ids
        if self.per_document_positions or images:
            inputs["positions"] = batch.positions
        if self.labels:
            inputs["labels"] = batch.labels
        return {**inputs, **images}

    @staticmethod
    def image_inputs(batch: Batch) -> dict[str, torch.Tensor]:
        """The keyword arguments that go row by row: the images (models/shared/vision_language.py)."""
        return getattr(batch, "per_row", dict)()

    def describe(self) -> str:
        mask = "block-causal (within documents)" if self.block_causal else "causal"
        positions = "per document" if self.per_document_positions else "global"
        loss = "; loss computed with the output projection in chunks" if self.labels else ""
        return f"attention {mask}, RoPE positions {positions}{loss}"


def config_problems(model: Model, training: Training, model_cls: type,
                    validation: Validation | None = None) -> list[tuple[str, str]]:
    """(full key, reason) when the model's forward cannot take what the config asks it to, or when "auto"
    would mean one thing for the training data and another for the validation data."""
    masking = DocumentMasking.from_config(model, training)
    if validation is not None and validation.enable and validation.dataset_format != training.dataset_format:
        for key in ("attention_mask", "positions"):
            if getattr(model, key) == "auto":
                return [(f"model.{key}", f"is ambiguous: training data is {training.dataset_format} and "
                                         f"validation data {validation.dataset_format}; set it explicitly")]
    accepted = inspect.signature(model_cls.forward).parameters
    problems = []
    for wanted, argument, key, value, fallback in (
        (masking.block_causal, "document_ids", "model.attention_mask", "block_causal", "causal"),
        (masking.per_document_positions, "positions", "model.positions", "per_document", "global"),
    ):
        if wanted and argument not in accepted:
            auto = f"(for chat data: {value}) " if getattr(model, key.split(".")[1]) == "auto" else ""
            problems.append((key, f"{auto}needs a model whose forward takes {argument}=, which "
                                  f"{model_cls.__name__} (model.name = {model.name!r}) does not; valid: {fallback!r}"))
    if training.loss_chunk_size > 0 and "labels" not in accepted:
        problems.append(("training.loss_chunk_size", f"needs a model whose forward takes labels= (and returns the "
                                                     f"summed loss), which {model_cls.__name__} (model.name = "
                                                     f"{model.name!r}) does not; valid: 0"))
    return problems
