"""Training objectives (components/objectives/objective.py): the losses and counts each one computes, against formulas
written out here, on fresh random inputs; a custom objective registered from outside the package; the config
check of training.objective."""

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F

from tests import z_loss_objective
from torchtitan.components.objectives.loss import build_cross_entropy_loss
from torchtitan.components.objectives.objective import OBJECTIVES, NextToken, NextTokenWithMTP, build_objective
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.data.dataset import IGNORE_INDEX, Batch
from torchtitan.inference import build_model
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.train import Trainer

VOCAB, ROWS, SEQ = 64, 3, 12


def random_labels(rows=ROWS, seq=SEQ) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (rows, seq))
    labels[torch.rand(rows, seq) < 0.25] = IGNORE_INDEX
    return labels


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def test_next_token_is_the_mean_cross_entropy_over_the_steps_valid_labels():
    objective = NextToken(build_cross_entropy_loss())
    batches = [Batch(torch.randint(0, VOCAB, (ROWS, SEQ)), random_labels(), None, None) for _ in range(2)]
    prepared = [objective.prepare(b) for b in batches]
    counts = sum(objective.count(targets) for _, targets in prepared)
    assert counts.tolist() == [sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)]
    logits = [torch.randn(ROWS, SEQ, VOCAB) for _ in batches]
    total = sum(objective.loss(out, targets, counts)[0] for out, (_, targets) in zip(logits, prepared))
    whole = mean_ce(torch.cat(logits), torch.cat([b.labels for b in batches]))
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)


def test_next_token_with_mtp_weighs_the_mean_over_depths():
    depth, weight = 2, 0.3
    objective = NextTokenWithMTP(build_cross_entropy_loss(), depth, weight, block_causal=False)
    batch = Batch(torch.randint(0, VOCAB, (ROWS, SEQ)), random_labels(), None, None)
    inputs, targets = objective.prepare(batch)
    assert set(inputs) == {"mtp_tokens", "mtp_labels"} and targets.shape == (ROWS, 1 + depth, SEQ)
    counts = objective.count(targets)
    logits = torch.randn(ROWS, SEQ, VOCAB)
    predictions = [torch.randn(ROWS, SEQ, VOCAB) for _ in range(depth)]
    loss, parts = objective.loss([logits, *predictions], targets, counts)
    main = mean_ce(logits, batch.labels)
    # Depth k predicts labels[i + k]: the last k positions have nothing to predict.
    extra = sum(mean_ce(p[:, :-k], batch.labels[:, k:]) for k, p in enumerate(predictions, start=1)) / depth
    torch.testing.assert_close(parts, torch.stack([main, extra]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, main + weight * extra, rtol=1e-5, atol=1e-6)


def test_a_custom_objective_on_the_tiny_model_equals_the_hand_computation():
    cfg, _ = load_config(["--job.config_file", "train_configs/tiny.toml", "--training.objective",
                          "next_token_z_loss"])
    model, _ = build_model(cfg, torch.device("cpu"))
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    labels = torch.randint(0, model.args.vocab_size, (2, 16))
    labels[:, :3] = IGNORE_INDEX
    objective = build_objective(cfg.training, build_cross_entropy_loss(), model.args, block_causal=False)
    _, targets = objective.prepare(Batch(tokens, labels, None, None))
    with torch.no_grad():
        logits = model(tokens).float()
        loss, parts = objective.loss(logits, targets, objective.count(targets))
    valid = labels != IGNORE_INDEX
    ce = mean_ce(logits, labels)
    z = (torch.logsumexp(logits, dim=-1)[valid] ** 2).mean()
    torch.testing.assert_close(parts, torch.stack([ce, z]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ce + z_loss_objective.COEFF * z, rtol=1e-5, atol=1e-5)


def test_training_objective_is_checked_against_the_registry():
    cfg, sources = load_config(["--job.config_file", "train_configs/debug_model.toml", "--training.objective",
                                "next_token_typo"])
    with pytest.raises(ConfigError, match="training.objective = 'next_token_typo' names no registered training "
                                          "objective; registered: .*next_token"):
        validate_config(cfg, sources, 1)
    assert "next_token" in OBJECTIVES


def test_the_chunked_loss_is_refused_for_an_objective_it_does_not_compute():
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", "--experimental.custom_import",
                                "tests.z_loss_objective", "--training.objective", "next_token_z_loss",
                                "--training.loss_chunk_size", "16"])
    with pytest.raises(ConfigError, match="training.loss_chunk_size = 16 computes the next-token loss inside the "
                                          "output head, which only the next_token objective uses"):
        validate_config(cfg, sources, 1)


def test_a_family_may_declare_args_without_defaults():
    # The contract's fields are keyword-only, so they do not force defaults on a family's own fields.
    @dataclasses.dataclass
    class Args(BaseModelArgs):
        dim: int
        n_layers: int = 2

    args = Args(64, vocab_size=100)
    assert (args.dim, args.n_layers, args.vocab_size, args.mtp_depth) == (64, 2, 100, 0)


def test_the_trainers_step_knows_no_objective_and_no_layout():
    # What differs between objectives lives in the objective, what differs between layouts in the runner.
    source = inspect.getsource(Trainer.train_step)
    for word in ("mtp", "pipeline", "shared_embedding"):
        assert word not in source, word
    assert not [name for name in vars(Trainer) if "pipeline_loss" in name]
