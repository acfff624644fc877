"""The planner counts GRPO's other models: the frozen reference (the bytes of the policy's own parameters on a
device, as it is built and sharded like the policy), the engine sampler's whole copy, none of the reference under
LoRA (the base is the reference), and sizes the generation cache for the rollouts."""

import pytest

from torchtitan.config import load_config
from torchtitan.hardware import DTYPES
from torchtitan.planner import model_shape, plan


def _plan(world_size: int, *flags: str):
    cfg, _ = load_config(["--job.config_file", "train_configs/grpo_debug.toml", *flags])
    return cfg, plan(cfg, "H100", world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_reference_and_the_sampler_are_counted(world_size):
    cfg, with_reference = _plan(world_size, "--rl.kl_coeff", "0.1")
    _, without = _plan(world_size)
    whole = model_shape(cfg).params * DTYPES[cfg.training.dtype].itemsize
    assert without.memory.rl == pytest.approx(whole)
    assert with_reference.memory.rl == pytest.approx(whole + with_reference.memory.params)
    assert with_reference.memory.total - without.memory.total == pytest.approx(with_reference.memory.params)
    rows = cfg.rl.prompts_per_step // world_size * cfg.rl.group_size
    assert f"for {rows} rows x" in with_reference.generation


def test_lora_has_no_reference_copy_and_next_token_has_no_rl_models():
    cfg, lora = _plan(1, "--rl.kl_coeff", "0.1", "--model.converters", "lora")
    assert lora.memory.rl == pytest.approx(model_shape(cfg).params * 4, rel=0.05)  # the sampler's copy alone
    plain, _ = load_config(["--job.config_file", "train_configs/debug_model.toml"])
    assert plan(plain, "H100").memory.rl == 0
