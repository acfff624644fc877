"""generation/sharded.py's layout rules (every rank runs the same batch) and its one-process build; the sharded
generation itself runs under torchrun in tests/integration/test_generation_sharded.py."""

import pytest
import torch

from torchtitan.config_check import load_model_config
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.generation.sharded import build_sharded_model, checked_model_args, layout_problems
from torchtitan.inference import build_model

LLAMA = "train_configs/debug_model.toml"
MOE = "train_configs/qwen3_moe_debug.toml"


@pytest.mark.parametrize("config, flags, world, key, words", [
    (LLAMA, ["--parallelism.pipeline_parallel_degree", "2"], 2, "pipeline_parallel_degree", "every block"),
    (LLAMA, ["--parallelism.context_parallel_degree", "2"], 2, "context_parallel_degree", "whole sequences"),
    (LLAMA, ["--parallelism.data_parallel_replicate_degree", "2"], 2, "data_parallel_replicate_degree", "same batch"),
    (LLAMA, ["--parallelism.data_parallel_shard_degree", "2"], 2, "data_parallel_shard_degree", "same batch"),
    (LLAMA, ["--parallelism.tensor_parallel_degree", "2"], 4, "tensor_parallel_degree", "world size is 4"),
    (LLAMA, [], 2, "tensor_parallel_degree", "world size is 2"),
    (LLAMA, ["--parallelism.expert_parallel_degree", "2"], 2, "expert_parallel_degree", "MoE layers"),
    (MOE, ["--parallelism.expert_parallel_degree", "3"], 3, "expert_parallel_degree", "num_experts = 8"),
])
def test_a_layout_generation_cannot_run_is_refused_in_one_line(config, flags, world, key, words):
    cfg = load_model_config(config, flags)
    with pytest.raises(ValueError) as error:
        checked_model_args(cfg, world)
    message = str(error.value)
    assert message.startswith(f"parallelism.{key} = ") and words in message and "\n" not in message, message


@pytest.mark.parametrize("flags, world", [(["--parallelism.tensor_parallel_degree", "2"], 2),
                                          (["--parallelism.expert_parallel_degree", "2"], 2),
                                          (["--parallelism.tensor_parallel_degree", "2",
                                            "--parallelism.expert_parallel_degree", "2"], 4),
                                          ([], 1)])
def test_tensor_and_expert_parallel_layouts_pass(flags, world):
    cfg = load_model_config(MOE, flags)
    assert layout_problems(cfg, world) == []


def test_without_data_parallelism_no_fsdp_wraps_the_expert_parallel_ranks():
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2, ep=2)
    assert dims.fsdp_enabled
    dims.data_parallel = False
    assert not dims.fsdp_enabled and dims.ep_enabled


def test_one_process_builds_the_plain_model_in_eval_mode():
    cfg = load_model_config(MOE, ["--debug.seed", "5"])
    model = build_sharded_model(cfg)
    reference, _ = build_model(load_model_config(MOE, ["--debug.seed", "5"]), mtp=False)
    assert not model.training
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
