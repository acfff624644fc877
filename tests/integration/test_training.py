"""Train in-process on the tiny flavor and check the numbers."""

import json

import pytest
import torch

from torchtitan.config import load_config
from torchtitan.config_check import validate_config
from torchtitan.train import Trainer, TrainingError


def make_trainer(tmp_path, *flags: str) -> Trainer:
    argv = ["--job.config_file", "train_configs/tiny.toml", f"--job.dump_folder={tmp_path}",
            "--training.mixed_precision_param", "float32", *flags]
    cfg, sources = load_config(argv)
    validate_config(cfg, sources, world_size=1)
    return Trainer(cfg)


def test_gradient_accumulation_equals_one_large_batch(tmp_path):
    """One step of local batch 8 == four micro-steps of 2: same loss, gradients and updated weights (fp32).

    Adam's eps is raised to 1e-6 for the weight check: with eps 1e-8 its first update, g / (|g| + eps),
    turns the fp32 rounding of the ~1e-9 gradients (summed in a different order) into ~3e-6 weight
    differences, which would hide the accumulation math this test is about.
    """
    flags = ("--training.steps", "1", "--optimizer.eps", "1e-6")
    big = make_trainer(tmp_path / "a", "--training.local_batch_size", "8", *flags)
    small = make_trainer(tmp_path / "b", "--training.local_batch_size", "2", "--training.global_batch_size", "8",
                         *flags)
    assert (big.grad_accum_steps, small.grad_accum_steps) == (1, 4)
    big_params = dict(big.model_parts[0].named_parameters())
    small_params = dict(small.model_parts[0].named_parameters())
    for name in big_params:
        assert torch.equal(big_params[name], small_params[name])  # same seed, same start
    before = {name: p.detach().clone() for name, p in big_params.items()}

    batch = next(iter(big.dataloader))
    data = iter(small.dataloader)
    micro = [next(data) for _ in range(4)]
    assert torch.equal(torch.cat([m[0] for m in micro]), batch[0])  # the same 8 sequences

    loss_big, norm_big = big.train_step([batch])
    loss_small, norm_small = small.train_step(micro)
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm_small, norm_big, rtol=1e-5, atol=1e-7)
    for name, p in big_params.items():
        torch.testing.assert_close(small_params[name].grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)
        torch.testing.assert_close(small_params[name], p, rtol=1e-6, atol=1e-6, msg=name)
        assert not torch.equal(p, before[name]), f"{name} was not updated"


def test_loss_is_the_token_mean_cross_entropy(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "1")
    batch = next(iter(trainer.dataloader))
    inputs, labels = batch.input_ids.to(trainer.device), batch.labels.to(trainer.device)
    model = trainer.model_parts[0]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss, _ = trainer.train_step([batch])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_tiny_model_learns_and_logs_every_step(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "60", "--metrics.log_freq", "10",
                           "--lr_scheduler.warmup_steps", "3", "--optimizer.lr", "3e-3")
    trainer.train()
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10, 20, 30, 40, 50, 60]
    assert {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s"} <= set(rows[0])
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(r["tps"] > 0 and r["memory_gib"] > 0 for r in rows)


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "5")
    original = trainer.objective.loss_fn
    calls = {"n": 0}

    def poisoned(logits, labels, tokens):
        calls["n"] += 1
        loss = original(logits, labels, tokens)
        return loss * float("nan") if calls["n"] == 3 else loss

    trainer.objective.loss_fn = poisoned
    with pytest.raises(TrainingError, match=r"non-finite loss and grad_norm at step 3 \(loss nan"):
        trainer.train()


def test_infinite_gradient_with_a_finite_loss_is_named_as_the_grad_norm(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "5")
    weight = trainer.model_parts[0].output.weight
    weight.register_hook(lambda grad: grad * float("inf") if trainer.step == 2 else grad)  # during step 3
    with pytest.raises(TrainingError, match=r"non-finite grad_norm at step 3 \(loss \d+\.\d+, grad_norm inf\)"):
        trainer.train()
    assert trainer.step == 3  # stopped there
