"""optimizer.name = "AdamW8bit": torchao's AdamW8bit, with moments that go through a checkpoint as float32 and
come back as the same codes and scales where the blocks are the same (and by torchao's quantisation where not),
and options that would do nothing refused."""

import copy

import pytest
import torch

from torchtitan.components.optimizers.adamw_8bit import requantize_
from torchtitan.components.optimizers.optimizer import build_optimizer
from torchtitan.config.job_config import Optimizer as OptimizerConfig


def _moments(seed: int, signed: bool) -> torch.Tensor:
    """Moment-like values: a spread of magnitudes, and for the signed map blocks whose largest magnitude is
    negative (the map ends at -0.99297, so those blocks' scales are not their largest magnitude)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(64, 256, generator=generator) * torch.logspace(-6, 0, 64)[:, None]
    return values if signed else values.square()


@pytest.mark.parametrize("signed", [True, False])
def test_dequantised_moments_come_back_as_the_same_codes_and_scales(signed):
    from torchao.optim.subclass_8bit import OptimState8bit

    original = OptimState8bit.zeros((64, 256), signed, 256)
    original.copy_(_moments(0, signed))  # torchao's quantisation
    assert (original.dequantize().reshape(-1, 256).amax(-1) < original.scale).any() or not signed
    restored = OptimState8bit.zeros((64, 256), signed, 256)
    requantize_(restored, original.dequantize())
    assert torch.equal(restored.codes, original.codes) and torch.equal(restored.scale, original.scale)


def test_values_from_other_blocks_are_quantised_as_torchao_does():
    from torchao.optim.subclass_8bit import OptimState8bit

    values = _moments(1, True)
    ours, theirs = (OptimState8bit.zeros((64, 256), True, 256) for _ in range(2))
    requantize_(ours, values)  # not dequantised from any block: no exact codes exist
    theirs.copy_(values)
    assert torch.equal(ours.codes, theirs.codes) and torch.equal(ours.scale, theirs.scale)


@pytest.mark.slow  # torchao compiles its step
def test_a_state_dict_round_trip_keeps_the_steps_bitwise():
    """Load a state dict into a fresh optimizer: it holds 8-bit moments again, and its next steps are the
    original's, bit for bit (a large matrix, quantised; a vector, kept in float32)."""
    cfg = OptimizerConfig(name="AdamW8bit", lr=1e-2)
    torch.manual_seed(0)
    weights = [torch.randn(64, 256), torch.randn(300)]
    runs = []
    for _ in range(2):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        runs.append((params, build_optimizer([torch.nn.ParameterList(params)], cfg)))
    generator = torch.Generator().manual_seed(1)
    grads = [[torch.randn(w.shape, generator=generator) for w in weights] for _ in range(5)]
    (first, optimizer), (second, restored) = runs
    for step in range(3):
        for p, g in zip(first, grads[step]):
            p.grad = g.clone()
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())  # as from a checkpoint: shares no tensor ("step")
    assert all(v.dtype == torch.float32 and type(v) is torch.Tensor for s in saved["state"].values()
               for k, v in s.items() if k != "step")
    with torch.no_grad():
        for p, q in zip(second, first):
            p.copy_(q)
    restored.load_state_dict(saved)
    assert type(restored.state[second[0]]["exp_avg"]).__name__ == "OptimState8bit"
    assert type(restored.state[second[1]]["exp_avg"]) is torch.Tensor
    for step in range(3, 5):
        for params in (first, second):
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
        optimizer.step()
        restored.step()
    assert all(torch.equal(p, q) for p, q in zip(first, second))


@pytest.mark.parametrize("flags, needles", [
    (["--optimizer.state_dtype", "bfloat16"], ["optimizer.state_dtype = 'bfloat16'", "must be float32"]),
    (["--optimizer.implementation", "foreach"], ["optimizer.implementation = 'foreach'", "would ignore it"]),
])
def test_options_adamw8bit_would_ignore_are_refused(tmp_path, flags, needles):
    from tests.bad_input import assert_one_line_error
    from torchtitan.train import main

    argv = ["--job.config_file", "train_configs/tiny.toml", f"--job.dump_folder={tmp_path}", "--optimizer.name",
            "AdamW8bit", *flags]
    assert_one_line_error(main, argv, *needles)


@pytest.mark.slow  # torchao compiles its step
def test_adamw_moments_load_into_adamw8bit():
    """AdamW's float32 moments load into AdamW8bit (the same state names), quantised, and it steps on."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 256))
    adamw = build_optimizer([torch.nn.ParameterList([weight])], OptimizerConfig(implementation="for-loop"))
    weight.grad = torch.randn_like(weight)
    adamw.step()
    low_bit = build_optimizer([torch.nn.ParameterList([weight])], OptimizerConfig(name="AdamW8bit"))
    low_bit.load_state_dict(copy.deepcopy(adamw.state_dict()))
    state = low_bit.state[weight]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit" and state["step"].item() == 1
    # the 8-bit moments are AdamW's to within half a code step of their blocks' scales
    for key in ("exp_avg", "exp_avg_sq"):
        original = adamw.state[weight][key]
        scale = original.reshape(-1, 256).abs().amax(-1, keepdim=True)
        error = (state[key].dequantize() - original).reshape(-1, 256).abs() / scale
        assert error.max() < 0.01, key
    low_bit.step()
    assert state["step"].item() == 2
