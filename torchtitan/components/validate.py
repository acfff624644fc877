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

from torchtitan.components.loss import LossFn, count_valid_tokens
from torchtitan.config.job_config import Validation
from torchtitan.data import DataError, Tokenizer, build_dataloader
from torchtitan.distributed.collectives import sum_over


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
    ):
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.device = device
        self.dp_mesh = dp_mesh
        self.autocast = autocast
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
        )

    def should_validate(self, step: int) -> bool:
        """Whether to validate after training step `step`."""
        return self.cfg.enable and step % self.cfg.freq == 0

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> dict[str, float]:
        """Run the model over the validation data; return val_loss, val_perplexity and val_tokens (global)."""
        if len(model_parts) != 1:
            raise ValueError(f"validation runs a single model part; got {len(model_parts)} (pipeline parallelism)")
        model = model_parts[0]
        was_training = model.training
        model.eval()
        # Summed in fp32 as [loss sum, valid tokens]; one all-reduce at the end.
        totals = torch.zeros(2, dtype=torch.float32, device=self.device)
        for batch_index, (input_ids, labels) in enumerate(self.dataloader):
            if self.cfg.steps != -1 and batch_index >= self.cfg.steps:
                break
            input_ids = input_ids.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.autocast():
                logits = model(input_ids)
            # The training loss divided by 1 instead of the global token count: the summed cross-entropy.
            totals[0] += self.loss_fn(logits, labels, 1.0).float()
            totals[1] += count_valid_tokens(labels)
            del logits
        model.train(was_training)
        loss_sum, tokens = sum_over(totals, self.dp_mesh).tolist()
        if tokens == 0:
            raise DataError(
                f"validation data ({self.cfg.dataset_path or self.cfg.dataset!r}) holds fewer tokens than one "
                f"validation batch at step {step}; lower validation.local_batch_size or validation.seq_len"
            )
        loss = loss_sum / tokens
        perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float beyond ~709
        return {"val_loss": loss, "val_perplexity": perplexity, "val_tokens": int(tokens)}
