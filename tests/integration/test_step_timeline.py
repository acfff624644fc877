"""Per-rank step phases in a real 2-process FSDP run (components/observability/): they change no loss, every rank
writes its timeline and trace, rank 0 summarises all ranks, and a rank whose data is late is named a straggler."""

import json

import pytest

from tests.integration import late_data_trainer
from tests.integration.parity import CONFIG, Matrix, rows_of
from torchtitan.components.observability.step_phases import PHASES

STEPS, STRAGGLER_STEPS = 20, 3
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.steps", str(STEPS)]


def suite_matrices(folder) -> dict[str, Matrix]:
    return {"obs_": Matrix({
        "late": (2, [*FSDP2, "--observability.straggler_steps", str(STRAGGLER_STEPS)],
                 "tests.integration.late_data_trainer:main"),
        "off": (2, [*FSDP2, "--observability.no_record_phases"]),
    }, CONFIG)}


def training_rows(rows):
    return [r for r in rows if "loss" in r]


@pytest.mark.slow
def test_recording_the_phases_changes_no_loss(debug_runs):
    recorded, plain = training_rows(rows_of(debug_runs, "obs_late")), training_rows(rows_of(debug_runs, "obs_off"))
    assert [r["step"] for r in recorded] == [r["step"] for r in plain] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in recorded] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert recorded[-1]["loss"] < recorded[0]["loss"]
    assert not any(key.startswith(("phase/", "memory/", "straggler/")) for r in plain for key in r)


@pytest.mark.slow
def test_every_rank_writes_its_timeline_and_rank_0_summarises_them(suite_runs):
    folder, runs = suite_runs
    timeline = folder / "obs_late" / "timeline"
    per_rank = [[json.loads(line) for line in (timeline / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for rank, rows in enumerate(per_rank):
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and {r["rank"] for r in rows} == {rank}
        assert all(list(r["phases"]) == list(PHASES) for r in rows)
        assert all("rss_gib" in r["memory"] for r in rows)  # log_freq 1: every step is a log step
        trace = json.loads((timeline / f"trace_rank{rank}.json").read_text())["traceEvents"]
        assert len([e for e in trace if e["ph"] == "X" and e["tid"] == 0]) == STEPS  # trace_steps 20
    rows = training_rows(rows_of(runs, "obs_late"))
    # Step 1's row has the memory but no phases: a row is written before its step ends, so it sums the steps before.
    assert "memory/peak_rss_gib/max" in rows[0] and "phase/data/max" not in rows[0]
    for row in rows[1:]:
        step = row["step"]
        data = [per_rank[r][step - 2]["phases"]["data"] for r in (0, 1)]  # log_freq 1: the one step before
        assert row["phase/data/max"] == pytest.approx(max(data), abs=2e-6)
        assert row["phase/data/min"] == pytest.approx(min(data), abs=2e-6)
        if step - 1 in late_data_trainer.STEPS:
            assert data[1] >= late_data_trainer.SECONDS and row["phase/data/slowest_rank"] == 1
            assert row["straggler/max_lag_rank"] == 1
            assert row["straggler/max_lag_s"] >= late_data_trainer.SECONDS - 0.05
        assert row["memory/peak_rss_gib/max"] == max(per_rank[r][step - 1]["memory"]["peak_rss_gib"] for r in (0, 1))
        assert row["memory/plan_gib"] > 0
    plan = json.loads((timeline / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["memory_gib"]["total"] == pytest.approx(row["memory/plan_gib"], abs=1e-4)


@pytest.mark.slow
def test_the_rank_with_late_data_is_named_a_straggler_in_data(suite_runs):
    folder, runs = suite_runs
    named = [line for line in (folder / "obs_late" / "train.log").read_text().splitlines() if "straggler:" in line]
    first = late_data_trainer.STEPS[0]
    # Late from step 4 on: behind at steps 4, 5, 6, named once at the third (within N + 1 steps), data as the phase.
    assert len(named) == 1, named
    assert f"rank {late_data_trainer.SLOW_RANK} (host " in named[0]
    assert f"fell behind in data at steps {first}-{first + STRAGGLER_STEPS - 1}:" in named[0]
    # The row of step 7 (N + 1 steps after the first late one) is the first that has seen step 6.
    named_at = first + STRAGGLER_STEPS
    events = [r.get("straggler/events", 0) for r in training_rows(rows_of(runs, "obs_late"))]
    assert events == [0] * (named_at - 1) + [1] * (STEPS - named_at + 1)
