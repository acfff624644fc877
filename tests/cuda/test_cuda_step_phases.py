"""The step-phase recorder on a GPU: phases timed by device events, read without synchronising a step."""

import json
import time

import pytest
import torch

from torchtitan.components.observability.step_phases import StepPhases
from torchtitan.config.job_config import Observability

pytestmark = pytest.mark.cuda


def test_device_phases_add_up_to_the_steps_wall_time(tmp_path):
    phases = StepPhases(Observability(), str(tmp_path), rank=0, device=torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    walls = []
    for step in range(1, 4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        phases.begin(step)
        time.sleep(0.05)  # the device idles while the host "loads data"
        phases.mark("data")
        for _ in range(20):
            a = torch.tanh(a @ a)
        phases.mark("forward_backward")
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        phases.end()
    phases.close()
    rows = [json.loads(line) for line in (tmp_path / "timeline" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row, wall in zip(rows, walls):
        assert row["phases"]["data"] == pytest.approx(0.05, abs=0.02)
        assert row["phases"]["forward_backward"] > 0.001  # 20 matmuls of 4096^3
        assert row["total_s"] == pytest.approx(wall, rel=0.2, abs=0.01)
