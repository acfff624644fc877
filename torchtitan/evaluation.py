"""Perplexity of a checkpoint on a dataset, computed exactly as training's validation computes it.

The work is done by the trainer's own Validator (summed token cross-entropy / valid tokens over the
validation split), in the same compute precision the single-process trainer uses (autocast to
training.mixed_precision_param when it differs from training.dtype), so an evaluation of a
checkpoint saved at step N reproduces the val_loss the run logged at step N.
"""

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from torchtitan.components.validate import Validator
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.data_parallel import DTYPES
from torchtitan.inference import load_model
from torchtitan.protocols.train_spec import get_train_spec


def compute_autocast(cfg: JobConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The trainer's precision on one process: autocast to the compute dtype if it differs from storage."""
    compute_dtype = DTYPES[cfg.training.mixed_precision_param]
    if compute_dtype == DTYPES[cfg.training.dtype]:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=compute_dtype)


def evaluate(
    config_file: str,
    checkpoint: str | None,
    *,
    overrides: list[str] = (),
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """val_loss, val_perplexity and val_tokens of ``checkpoint`` on the config's [validation] data.

    ``overrides`` are trainer-style flags (e.g. ``--validation.dataset_path data.jsonl``) applied to
    the config, so anything the [validation] section can name can be evaluated.
    """
    from torchtitan.config import load_config

    device = torch.device(device)
    cfg, _ = load_config(["--job.config_file", str(config_file), *overrides])
    model = load_model(config_file, checkpoint, device=str(device), overrides=overrides)
    model.to(DTYPES[cfg.training.dtype])  # the dtype the trainer stores (and validates) parameters in
    spec = get_train_spec(cfg.model.name)
    tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
    # Validator checks nothing about `enable`; it reads the split the [validation] section names.
    validation = dataclasses.replace(cfg.validation, enable=True)
    validator = Validator(validation, tokenizer, dp_rank=0, dp_world_size=1, loss_fn=spec.build_loss_fn(),
                          device=device, autocast=compute_autocast(cfg, device))
    return validator.validate([model], step=0)
