"""Periodic validation: loss and perplexity on held-out data, reduced exactly like the training loss.

The validation loss is the token-mean cross-entropy over the whole validation set (or its first
``validation.steps`` micro-batches per rank): the summed loss of every token on every data-parallel
rank divided by the global count of valid tokens, the same reduction the training step uses. Each
rank reads its share of one packed stream of the held-out split, so the number is the same under
any data-parallel layout, and every rank runs the same number of forward passes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.objectives.loss import LossFn, count_valid_tokens
from torchtitan.config.job_config import Validation
from torchtitan.data import Batch, DataError, Tokenizer, build_dataloader
from torchtitan.data.config import Chat
from torchtitan.data.image_chat import ImageChat
from torchtitan.distributed.collectives import sum_over

# (model parts, batch) -> (summed token cross-entropy, valid tokens) of one batch on this rank.
BatchLoss = Callable[[list[nn.Module], Batch], tuple[torch.Tensor, torch.Tensor]]


def config_problems(cfg: Validation, training_seq_len: int) -> list[tuple[str, str]]:
    """Problems with the [validation] section's own numbers as (field, reason) pairs (none when it is off)."""
    if not cfg.enable:
        return []
    problems = [(field, "is invalid; it must be > 0") for field in ("freq", "local_batch_size", "seq_len")
                if getattr(cfg, field) <= 0]
    if not (cfg.steps == -1 or cfg.steps > 0):
        problems.append(("steps", "is invalid; it must be -1 (the whole split) or > 0"))
    if cfg.seq_len > training_seq_len:
        problems.append(("seq_len", f"is longer than training.seq_len = {training_seq_len}, the longest sequence the "
                                    f"model is built for; set it <= {training_seq_len}"))
    return problems


class Validator:
    """Computes val_loss and val_perplexity every ``validation.freq`` steps."""

    def __init__(
        self,
        cfg: Validation,
        tokenizer: Tokenizer,
        *,
        dp_rank: int,
        dp_world_size: int,
        loss_fn: LossFn,
        device: torch.device,
        dp_mesh: DeviceMesh | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        batch_loss: BatchLoss | None = None,
        model_inputs: Callable[[Batch], dict] = lambda batch: {},
        chat: Chat | None = None,
        image_chat: ImageChat | None = None,
    ):
        """``dp_mesh`` is what the sums are reduced over (data x context parallel ranks). ``batch_loss``
        replaces the plain forward of one model part, for layouts that split the model or the sequence;
        ``model_inputs`` gives the plain forward's keyword arguments (document ids, positions); ``chat`` how
        chat data is read and packed (training.chat); ``image_chat`` how a vision-language model reads images."""
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.device = device
        self.dp_mesh = dp_mesh
        self.autocast = autocast
        self.batch_loss = batch_loss or self._forward_one_part
        self.model_inputs = model_inputs
        # Read once per validation, from the start: the same batches every time.
        self.dataloader = build_dataloader(
            tokenizer,
            dataset=cfg.dataset,
            dataset_path=cfg.dataset_path,
            seq_len=cfg.seq_len,
            local_batch_size=cfg.local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            text_column=cfg.dataset_text_column,
            split="validation",
            infinite=False,
            dataset_format=cfg.dataset_format,
            chat=chat,
            image_chat=image_chat,
        )

    def should_validate(self, step: int) -> bool:
        """Whether to validate after training step `step`."""
        return self.cfg.enable and step % self.cfg.freq == 0

    def _forward_one_part(self, model_parts: list[nn.Module], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if len(model_parts) != 1:
            raise ValueError(f"validation of {len(model_parts)} model parts needs a batch_loss")
        batch = batch.to(self.device)
        with self.autocast():
            logits = model_parts[0](batch.input_ids, **self.model_inputs(batch))
        # The training loss divided by 1 instead of the global token count: the summed cross-entropy.
        return self.loss_fn(logits, batch.labels, 1.0), count_valid_tokens(batch.labels)

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> dict[str, float]:
        """Run the model over the validation data; return val_loss, val_perplexity and val_tokens (global)."""
        was_training = model_parts[0].training
        for part in model_parts:
            part.eval()
        # Summed in fp32 as [loss sum, valid tokens]; one all-reduce at the end.
        totals = torch.zeros(2, dtype=torch.float32, device=self.device)
        for batch_index, batch in enumerate(self.dataloader):
            if self.cfg.steps != -1 and batch_index >= self.cfg.steps:
                break
            loss_sum, tokens = self.batch_loss(model_parts, batch)
            totals[0] += loss_sum.float()
            totals[1] += tokens
        for part in model_parts:
            part.train(was_training)
        loss_sum, tokens = sum_over(totals, self.dp_mesh).tolist()
        if tokens == 0:
            raise DataError(
                f"validation data ({self.cfg.dataset_path or self.cfg.dataset!r}) holds fewer tokens than one "
                f"validation batch at step {step} (or, chat data, no trained tokens in it); lower "
                f"validation.local_batch_size or validation.seq_len"
            )
        loss = loss_sum / tokens
        perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float beyond ~709
        return {"val_loss": loss, "val_perplexity": perplexity, "val_tokens": int(tokens)}
