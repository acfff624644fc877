"""Perplexity of a checkpoint on a dataset, computed exactly as training's validation computes it.

The work is done by the trainer's own Validator (summed token cross-entropy / valid tokens over the
validation split), in the same compute precision the single-process trainer uses (autocast to
training.mixed_precision_param when it differs from training.dtype), so an evaluation of a
checkpoint saved at step N reproduces the val_loss the run logged at step N.
"""

import dataclasses

import torch

from torchtitan.components.evaluation.validate import Validator
from torchtitan.components.objectives.loss import build_cross_entropy_loss
from torchtitan.config import ConfigError, ConfigSources
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.precision import compute_autocast, set_compute_dtype
from torchtitan.hardware import DTYPES
from torchtitan.inference import load_model
from torchtitan.models.shared.document_masking import DocumentMasking
from torchtitan.protocols.train_spec import get_train_spec


def check_validation_shape(cfg: JobConfig, sources: ConfigSources) -> None:
    """Raise ConfigError unless the validation batches fit the model.

    Config validation only checks [validation] when training validates (validation.enable), but an
    evaluation always reads it; a seq_len beyond training.seq_len would index past the model's RoPE
    table and fail deep inside the forward with a shape error.
    """
    v, longest = cfg.validation, cfg.training.seq_len
    if not 0 < v.seq_len <= longest:
        raise ConfigError(f"{sources.describe('validation.seq_len')}: validation.seq_len = {v.seq_len} is invalid; "
                          f"it must be in 1..{longest} (training.seq_len, the longest sequence the model is built for)")
    if v.local_batch_size < 1:
        raise ConfigError(f"{sources.describe('validation.local_batch_size')}: validation.local_batch_size = "
                          f"{v.local_batch_size} is invalid; it must be >= 1")


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
    cfg, sources = load_config(["--job.config_file", str(config_file), *overrides])  # load_model checks [model]
    check_validation_shape(cfg, sources)
    set_compute_dtype(cfg.training, device.type)
    model = load_model(config_file, checkpoint, device=str(device), overrides=overrides)
    model.to(DTYPES[cfg.training.dtype])  # the dtype the trainer stores (and validates) parameters in
    spec = get_train_spec(cfg.model.name)
    tokenizer = spec.build_tokenizer_fn(cfg.model.hf_assets_path)
    # Validator checks nothing about `enable`; it reads the split the [validation] section names.
    validation = dataclasses.replace(cfg.validation, enable=True)
    loss_fn = (spec.build_loss_fn or build_cross_entropy_loss)()
    validator = Validator(validation, tokenizer, dp_rank=0, dp_world_size=1, loss_fn=loss_fn,
                          device=device, autocast=compute_autocast(cfg.training, device),
                          model_inputs=DocumentMasking.from_config(cfg.model, cfg.training).model_inputs,
                          chat=cfg.training.chat)
    return validator.validate([model], step=0)
