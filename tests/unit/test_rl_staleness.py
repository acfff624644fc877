"""The staleness bound of asynchronous GRPO (rollouts.py's check_staleness): a batch from the generator is the one
the step needs and at most rl.max_staleness versions older than the step."""

import pytest

from torchtitan.data import DataError
from torchtitan.generation.sampling import SamplingConfig
from torchtitan.rl.rollouts import BatchInputs, check_staleness


def batch(step: int, index: int) -> BatchInputs:
    return BatchInputs(step, index, [{"prompt": "p"}], [[1, 2]], SamplingConfig())


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("step", [0, 3, 10])
def test_versions_within_the_bound_pass_and_older_ones_are_refused(k, step):
    index = step // 2
    for version in range(max(0, step - k), step + 1):
        check_staleness(batch(step, index), step, index, version, k)
    if step - k - 1 >= 0:
        with pytest.raises(DataError) as info:
            check_staleness(batch(step, index), step, index, step - k - 1, k)
        assert str(info.value) == (
            f"rl: batch {index} (for step {step}) came from policy version {step - k - 1}, but step {step} needs "
            f"batch {index} from version {step - k} or newer (rl.max_staleness = {k}): the generator process broke "
            "the staleness bound")


@pytest.mark.parametrize("made_for", [(6, 3), (4, 3), (2, 2)])
def test_a_batch_made_for_another_step_or_position_is_refused(made_for):
    step, index = made_for
    check_staleness(batch(4, 2), 4, 2, 4, 1)  # the batch the step needs passes
    expected = rf"^rl: batch {index} \(for step {step}\) came from policy version 4, but step 4 needs batch 2 from"
    with pytest.raises(DataError, match=expected):
        check_staleness(batch(step, index), 4, 2, 4, 1)
