"""The layout a plan is made for: the trainer's own arithmetic of parallel degrees, without a process group, and the
error every planning step raises."""

import math

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims


class PlanError(ValueError):
    """The plan cannot be made; the message names the input and what is valid."""


def resolve_layout(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The trainer's layout arithmetic (no process group needed), with its errors as PlanError."""
    try:
        return ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as e:
        raise PlanError(f"parallelism.data_parallel_shard_degree = {cfg.parallelism.data_parallel_shard_degree} "
                        f"{e}") from None


def layout_problem(parallelism, world_size: int) -> str | None:
    """Why the degrees of ``parallelism`` cannot lay out on ``world_size`` ranks (the checks config validation
    makes: they multiply to it, expert parallelism is carved from dp_shard x cp), or None."""
    try:
        dims = ParallelDims.from_config(parallelism, world_size)
    except ValueError as e:
        return str(e)
    return dims.expert_parallel_problem()


def smallest_world_size(parallelism) -> int | None:
    """The fewest ranks the degrees of ``parallelism`` lay out on, or None if no world size fits them."""
    p = parallelism
    degrees = (p.data_parallel_replicate_degree, p.context_parallel_degree, p.tensor_parallel_degree,
               p.pipeline_parallel_degree, p.expert_parallel_degree)
    if min(degrees) < 1 or p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        return None
    others = math.prod(degrees[:4])
    if p.data_parallel_shard_degree != -1:
        candidates = [others * p.data_parallel_shard_degree]
    else:
        # dp_shard = ep ranks always carves expert parallelism out of dp_shard x cp if anything does.
        candidates = [others * k for k in range(1, p.expert_parallel_degree + 1)]
    return next((w for w in candidates if layout_problem(p, w) is None), None)
