"""The bad-step guard (training.guard): injected non-finite gradients and loss spikes are skipped and counted,
change nothing, stop the run when they persist, and resume exactly."""

import json

import pytest
import torch

from tests.integration.test_training import make_trainer
from torchtitan.train import TrainingError

GUARD = ("--training.guard.enable", "--training.guard.window", "3", "--training.guard.spike_factor", "3",
         "--training.guard.max_consecutive", "2", "--metrics.log_freq", "1")


def inject(trainer, nonfinite=(), spikes=()):
    """Make chosen steps bad: an infinite embedding gradient (its norm is then inf/NaN), or the loss x 100."""
    embedding = trainer.model_parts[0].tok_embeddings.weight
    embedding.register_hook(lambda g: g * float("inf") if trainer.step + 1 in nonfinite else g)
    # The objective scores every step (components/objectives/objective.py): its loss function is where a spike goes in.
    loss_fn = trainer.objective.loss_fn
    trainer.objective.loss_fn = lambda logits, labels, n: (
        loss_fn(logits, labels, n) * (100.0 if trainer.step + 1 in spikes else 1.0))


def rows(dump):
    """Step -> metrics row (a relaunch's row wins)."""
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def snapshot(trainer):
    params = {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}
    state = {n: {k: v.clone() for k, v in s.items()} for n, s in trainer.optimizer.state_dict()["state"].items()}
    return params, state


def test_bad_steps_are_skipped_counted_and_change_nothing_and_the_run_trains_on(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "8", *GUARD)
    inject(trainer, nonfinite={5}, spikes={6})
    changed, train_step = {}, trainer.train_step

    def observed_step(microbatches):
        before = snapshot(trainer)
        result = train_step(microbatches)
        after = snapshot(trainer)
        changed[trainer.step + 1] = (
            not all(torch.equal(before[0][n], p) for n, p in after[0].items()),
            before[1].keys() != after[1].keys() or
            not all(torch.equal(before[1][n][k], v) for n, s in after[1].items() for k, v in s.items()))
        assert trainer.lr_scheduler.last_epoch == trainer.step + 1  # the schedule moves on, skipped or not
        return result

    trainer.train_step = observed_step
    trainer.train()
    trainer.close()
    assert [step for step, (params, state) in changed.items() if not params and not state] == [5, 6]
    assert all(state for step, (params, state) in changed.items() if step not in (5, 6))
    assert all(params for step, (params, state) in changed.items() if step not in (5, 6, 8))  # step 8: lr 0
    logged = rows(tmp_path)
    assert [logged[s]["guard/skipped_steps"] for s in range(1, 9)] == [0, 0, 0, 0, 1, 2, 2, 2]
    assert logged[5]["grad_norm"] != logged[5]["grad_norm"]  # NaN, logged as is
    assert logged[6]["loss"] > 50 and all(logged[s]["loss"] < 10 for s in (7, 8))
    assert trainer.guard.consecutive == 0


def test_too_many_skipped_steps_in_a_row_stop_the_run(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "8", *GUARD)
    inject(trainer, nonfinite={4, 5, 6})
    with pytest.raises(TrainingError, match=r"^step 6: 3 steps in a row were skipped by the bad-step guard \(more "
                                            r"than training.guard.max_consecutive = 2; the last: loss .*not finite\)"):
        trainer.train()
    trainer.close()
    assert trainer.guard.skipped == 3


def test_resume_after_a_skip_is_exact(tmp_path):
    """Skip at step 4, checkpoint at step 5, a spike at step 7: the resumed run judges step 7 from the restored
    window (without it, the window would not be full and step 7 would be kept) and logs what the straight run
    logged."""
    flags = ("--training.steps", "8", *GUARD, "--checkpoint.enable", "--checkpoint.interval", "5",
             "--checkpoint.last_save_model_only=false")
    straight = make_trainer(tmp_path / "straight", *flags)
    inject(straight, nonfinite={4}, spikes={7})
    straight.train()
    straight.close()
    first = make_trainer(tmp_path / "resumed", *flags)
    inject(first, nonfinite={4}, spikes={7})
    loss_fn = first.objective.loss_fn

    def crash_at_step_6(*args):
        if first.step + 1 == 6:
            raise RuntimeError("crash")
        return loss_fn(*args)

    first.objective.loss_fn = crash_at_step_6
    with pytest.raises(RuntimeError, match="crash"):
        first.train()
    first.close()
    second = make_trainer(tmp_path / "resumed", *flags)
    assert second.step == 5 and second.guard.skipped == 1 and len(second.guard.losses) == 3
    inject(second, nonfinite={4}, spikes={7})
    second.train()
    second.close()
    keys = ("loss", "grad_norm", "lr", "guard/skipped_steps")
    expected, ours = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert [[ours[s][k] for k in keys] for s in range(1, 9)] == [[expected[s][k] for k in keys] for s in range(1, 9)]
    assert [expected[s]["guard/skipped_steps"] for s in (6, 7)] == [1, 2]


def test_a_skipped_step_leaves_the_moe_routing_biases_and_counts_alone(tmp_path):
    from tests.integration.test_moe import _moe_trainer

    trainer = _moe_trainer(tmp_path, "--training.steps", "3", *GUARD)
    inject(trainer, nonfinite={2})
    data = iter(trainer.dataloader)
    biases = lambda: [m.expert_bias.clone() for m in trainer.model_parts[0].modules() if hasattr(m, "expert_bias")]  # noqa: E731
    trainer.train_step([next(data)])
    trainer.train_state.step = 1
    before, counts = biases(), trainer.expert_loads.counts.clone()
    trainer.train_step([next(data)])  # skipped
    trainer.train_state.step = 2
    assert trainer.guard.skipped == 1 and before
    assert all(torch.equal(a, b) for a, b in zip(before, biases()))
    assert torch.equal(trainer.expert_loads.counts, counts)
    trainer.train_step([next(data)])  # kept: the biases move on this step's loads alone
    assert not all(torch.equal(a, b) for a, b in zip(before, biases()))
    assert trainer.expert_loads.counts.sum() == counts.sum()  # one step's routed tokens, not two


def test_guard_settings_are_checked_naming_the_field():
    from torchtitan.config import ConfigError
    from torchtitan.config_check import load_and_validate

    for flag, value, reason in (("spike_factor", "0.5", "it must be > 1 (or 0: no spike check)"),
                                ("window", "0", "it must be >= 1"), ("max_consecutive", "-1", "it must be >= 0")):
        with pytest.raises(ConfigError) as error:
            load_and_validate(["--job.config_file", "train_configs/tiny.toml", f"--training.guard.{flag}", value])
        assert str(error.value).endswith(f"training.guard.{flag} = {value} is invalid; {reason}"), error.value
