"""training.objective = "grpo": GRPO's loss (components/objectives/grpo.py) on the policy's own rollouts."""

from torchtitan.components.objectives.grpo import GRPO
from torchtitan.components.objectives.objective import OBJECTIVES, DataSourceContext
from torchtitan.config.job_config import RL
from torchtitan.rl.rollouts import RolloutSource


class GRPOOnRollouts(GRPO):
    def build_data_source(self, context: DataSourceContext) -> RolloutSource:
        """The rollouts this objective trains on, in place of a dataset's loader."""
        return RolloutSource(self.rl, context)


def _grpo(rl: RL, **_) -> GRPOOnRollouts:
    return GRPOOnRollouts(rl)


OBJECTIVES.register("grpo", _grpo)
