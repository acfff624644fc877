import math

import pytest
import torch

from torchtitan.components.optimizers.lr_scheduler import build_lr_scheduler, lr_factor
from torchtitan.config.job_config import LRScheduler


def test_warmup_then_linear_decay_to_min():
    cfg = LRScheduler(warmup_steps=4, decay_type="linear", min_lr_factor=0.1)
    factors = [lr_factor(s, cfg, 14) for s in range(1, 15)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(factors[-1], 0.1)
    assert all(a > b for a, b in zip(factors[3:], factors[4:]))  # decays right after warmup


def test_warmup_stable_decay():
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear")
    factors = [lr_factor(s, cfg, 12) for s in range(1, 13)]
    assert factors[2:7] == [1.0] * 5  # stable for half of the 10 post-warmup steps
    assert factors[7] < 1.0 and factors[-1] == 0.0


@pytest.mark.parametrize("kind,mid", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_decay_shapes(kind, mid):
    cfg = LRScheduler(warmup_steps=0, decay_type=kind)
    assert math.isclose(lr_factor(5, cfg, 10), mid)
    assert math.isclose(lr_factor(10, cfg, 10), 0.0, abs_tol=1e-12)


def test_scheduler_applies_the_factor_of_each_step():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    cfg = LRScheduler(warmup_steps=3, decay_type="cosine")
    sched = build_lr_scheduler(opt, cfg, total_steps=8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * lr_factor(s, cfg, 8) for s in range(1, 9)])
