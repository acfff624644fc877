"""ParallelDims: degrees resolved from the config, and sub-meshes asked for by name."""

import pytest

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.parallel_dims import MESH_NAMES, ParallelDims


def test_a_misspelt_dimension_raises_naming_the_valid_ones():
    dims = ParallelDims.from_config(Parallelism(), world_size=1)
    with pytest.raises(ValueError, match=r"no mesh dimension named 'dp_shrad'; valid: pp, dp_replicate, dp_shard, "
                                         r"cp, tp, dp, dp_shard_cp, dp_cp"):
        dims.submesh("dp_shrad")
    # Every real name answers, with None for a dimension of size 1 (no mesh on one process).
    assert all(dims.submesh(name) is None for name in MESH_NAMES)


def test_minus_one_shard_degree_takes_the_ranks_left_over():
    dims = ParallelDims.from_config(Parallelism(tensor_parallel_degree=2, data_parallel_replicate_degree=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2, 4)


@pytest.mark.parametrize("global_batch, local, replicate, world, expected", [
    (-1, 4, 1, 2, (8, 1)), (16, 2, 2, 4, (16, 2)), (8, 1, 2, 8, (8, 1))])
def test_batch_arithmetic(global_batch, local, replicate, world, expected):
    from torchtitan.config.job_config import Training

    dims = ParallelDims.from_config(Parallelism(data_parallel_replicate_degree=replicate), world)
    training = Training(global_batch_size=global_batch, local_batch_size=local)
    assert (dims.global_batch_size(training), dims.grad_accum_steps(training)) == expected


def test_degrees_that_do_not_fill_the_world_say_why():
    with pytest.raises(ValueError, match="cannot fill the world size 6: the other degrees multiply to 4"):
        ParallelDims.from_config(Parallelism(tensor_parallel_degree=4), 6)
    with pytest.raises(ValueError, match=r"replicate x shard x tp x pp x cp = 4, but the world size is 8"):
        ParallelDims.from_config(Parallelism(data_parallel_shard_degree=2, tensor_parallel_degree=2), 8)


def test_the_planner_lays_out_with_parallel_dims():
    from torchtitan.config import load_config
    from torchtitan.planner import plan

    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml", "--parallelism.tensor_parallel_degree",
                          "2", "--training.seq_len", "256"])
    layout = plan(cfg, "H100", world_size=8).layout
    assert isinstance(layout, ParallelDims) and (layout.dp_shard, layout.tp, layout.fsdp_degree) == (4, 2, 4)
