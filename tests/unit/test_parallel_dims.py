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
