"""The step-phase recorder, the per-rank summary and straggler detection (components/observability/)."""

import json
import time

import pytest
import torch

from tests.bad_input import assert_one_line_error
from torchtitan.components.observability.lag import lag_behind, phase_end_lags
from torchtitan.components.observability.rank_summary import RankSummary, StragglerDetector, memory_readings
from torchtitan.components.observability.step_phases import PHASES, StepPhases
from torchtitan.config.job_config import Observability
from torchtitan.train import main as train_main


def record(tmp_path, sleeps: list[dict[str, float]], cfg=None) -> StepPhases:
    """Steps whose phases sleep the given seconds (phases left out are not marked)."""
    phases = StepPhases(cfg or Observability(), str(tmp_path), rank=3, device=torch.device("cpu"))
    for step, plan in enumerate(sleeps, start=1):
        phases.begin(step)
        for phase in PHASES:
            if phase in plan:
                time.sleep(plan[phase])
                phases.mark(phase)
        phases.end()
    return phases


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_phase_is_the_time_since_the_previous_mark(tmp_path):
    sleeps = [{"data": 0.03, "forward_backward": 0.06, "optimizer": 0.01},
              {"data": 0.0, "forward_backward": 0.02, "grad_comm": 0.04, "checkpoint": 0.05}]
    phases = record(tmp_path, sleeps)
    phases.close()
    written = rows(tmp_path / "timeline" / "rank3.jsonl")
    assert [r["step"] for r in written] == [1, 2] and {r["rank"] for r in written} == {3}
    for row, plan in zip(written, sleeps):
        assert list(row["phases"]) == list(PHASES)
        for phase in PHASES:
            # Sleeping took at least what was asked and not much more; a phase not marked is 0.
            assert plan.get(phase, 0.0) <= row["phases"][phase] < plan.get(phase, 0.0) + 0.03, (phase, row)
        assert row["total_s"] == pytest.approx(sum(row["phases"].values()), abs=1e-5)
    assert written[1]["start"] - written[0]["start"] == pytest.approx(written[0]["total_s"], abs=0.02)


def test_an_abandoned_step_leaves_no_row_and_memory_goes_into_its_row(tmp_path):
    phases = StepPhases(Observability(), str(tmp_path), rank=0, device=torch.device("cpu"))
    phases.begin(1)
    phases.mark("data")
    phases.abandon()  # e.g. a replica group failed during it: redone as step 1
    phases.begin(1)
    phases.mark("data")
    phases.note_memory({"rss_gib": 1.5})
    phases.end()
    phases.close()
    written = rows(tmp_path / "timeline" / "rank0.jsonl")
    assert [(r["step"], r["memory"]) for r in written] == [(1, {"rss_gib": 1.5})]


def test_the_file_is_rotated_beyond_its_size_and_the_trace_holds_the_last_steps(tmp_path):
    cfg = Observability(max_file_mb=0.001, trace_steps=3)  # 1000 bytes: about 3 rows
    phases = record(tmp_path, [{"data": 0.0, "forward_backward": 0.001}] * 12, cfg)
    phases.close()
    folder = tmp_path / "timeline"
    current, older = rows(folder / "rank3.jsonl"), rows(folder / "rank3.jsonl.1")
    assert (folder / "rank3.jsonl").stat().st_size <= 1000
    steps = [r["step"] for r in older + current]
    assert steps == list(range(steps[0], 13)) and steps[0] > 1  # the oldest rows are gone, the rest in order
    trace = json.loads((folder / "trace_rank3.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X" and e["tid"] == 0]
    assert [e["args"]["step"] for e in spans] == [10, 11, 12]
    inner = [e for e in trace if e["ph"] == "X" and e["tid"] == 1 and e["args"]["step"] == 12]
    assert "forward_backward" in [e["name"] for e in inner] and {e["name"] for e in inner} <= {"data",
                                                                                               "forward_backward"}
    last = spans[-1]
    assert all(last["ts"] <= e["ts"] and e["ts"] + e["dur"] <= last["ts"] + last["dur"] + 1 for e in inner)


def test_one_process_summary_has_every_phase_and_memory_kind(tmp_path):
    phases = record(tmp_path, [{"data": 0.01, "forward_backward": 0.02}] * 3)
    memory = memory_readings(torch.device("cpu"))
    assert memory["peak_rss_gib"] > 0.05
    summary = RankSummary(Observability(), 0, torch.device("cpu"), window=5, memory_kinds=tuple(memory))
    metrics = summary.gather(phases.take_finished(), memory)
    assert 0.01 <= metrics["phase/data/median"] < 0.03 and metrics["phase/forward_backward/slowest_rank"] == 0
    assert metrics["phase/total/max"] == pytest.approx(metrics["phase/data/max"] + metrics["phase/forward_backward/max"]
                                                       + sum(metrics[f"phase/{p}/max"] for p in PHASES[2:]), abs=1e-5)
    assert metrics["memory/peak_rss_gib/max"] == memory["peak_rss_gib"]
    assert metrics["straggler/events"] == 0
    assert summary.gather(phases.take_finished(), memory).keys().isdisjoint({"phase/data/min"})  # nothing new


def steps_with(ranks: int, slow_rank: int, phase: str, lag: float, slow_steps: range, total: int = 12,
               step_time: float = 0.1):
    """Synthetic synchronous steps: the slow rank spends ``lag`` more in ``phase``; the others wait for it in the
    next phase that holds a collective (forward_backward, grad_comm), or, after those, at the next step's."""
    syncs = [PHASES.index("forward_backward"), PHASES.index("grad_comm")]
    start = 1000.0
    starts, phase_rows = [], []
    late_start = 0.0  # the slow rank's lateness carried into the next step
    for step in range(1, total + 1):
        p = torch.full((ranks, len(PHASES)), step_time / len(PHASES), dtype=torch.float64)
        s = torch.full((ranks,), start, dtype=torch.float64)
        s[slow_rank] += late_start
        extra = lag if step in slow_steps else 0.0
        index = PHASES.index(phase)
        p[slow_rank, index] += extra
        waited = late_start + extra
        sync = next((i for i in syncs if i >= index), None) if extra else (syncs[0] if late_start else None)
        if sync is not None and waited:
            others = [r for r in range(ranks) if r != slow_rank]
            p[others, sync] += waited
            late_start = 0.0
        else:
            late_start = extra  # slow after the last collective: late into the next step
        starts.append(s)
        phase_rows.append(p)
        start = float((s + p.sum(dim=1)).min())
    return starts, phase_rows


@pytest.mark.parametrize("ranks, seed", [(2, 0), (5, 1), (8, 2)])
def test_phase_end_lags_are_each_ranks_phase_ends_less_the_lower_median_ranks(ranks, seed):
    generator = torch.Generator().manual_seed(seed)
    starts = 1.7e9 + torch.rand(ranks, generator=generator, dtype=torch.float64)
    phases = torch.rand(ranks, len(PHASES), generator=generator, dtype=torch.float64)
    # The reference in torch: its median of an even count is the lower middle value, the one ahead.
    ends = torch.cat([starts[:, None], starts[:, None] + phases.cumsum(dim=1)], dim=1)
    expected = ends - ends.median(dim=0, keepdim=True).values
    lags = phase_end_lags(starts.tolist(), phases.tolist())
    assert torch.tensor(lags, dtype=torch.float64).allclose(expected, rtol=0, atol=1e-6)
    assert [lag_behind(row) for row in lags] == pytest.approx(expected[:, 1:].max(dim=1).values.clamp(min=0).tolist(),
                                                              abs=1e-6)
    # At each point the median rank is the lower middle one: (ranks - 1) // 2 ranks are ahead of it (of two, none).
    assert [sum(lag < 0 for lag in column) for column in zip(*lags)] == [(ranks - 1) // 2] * (len(PHASES) + 1)


@pytest.mark.parametrize("ranks,slow_rank,phase", [(2, 1, "data"), (4, 2, "optimizer"), (5, 0, "checkpoint"),
                                                   (3, 1, "forward_backward")])
def test_the_straggler_is_named_with_its_phase_after_n_steps(ranks, slow_rank, phase):
    cfg = Observability(straggler_steps=3, straggler_fraction=0.2)
    detector = StragglerDetector(cfg, [f"host{r}" for r in range(ranks)])
    starts, phases = steps_with(ranks, slow_rank, phase, lag=0.3, slow_steps=range(4, 10))
    for step, (s, p) in enumerate(zip(starts, phases), start=1):
        detector.check(step, s, p)
    if phase == "forward_backward":
        # Slow work inside a phase that ends in a collective: everyone leaves it together, nobody is late.
        assert detector.named == []
        return
    assert detector.named == [(slow_rank, phase, 6)]  # steps 4, 5, 6 behind: named at the third
    assert detector.events == 1


def test_a_rank_behind_for_fewer_steps_or_by_less_is_not_named():
    cfg = Observability(straggler_steps=3, straggler_fraction=0.2)
    detector = StragglerDetector(cfg, ["a", "b", "c"])
    for slow_steps, lag in ((range(2, 4), 0.5), (range(5, 11), 0.01)):  # twice in a row; 1% of a step
        for step, (s, p) in enumerate(zip(*steps_with(3, 2, "data", lag, slow_steps)), start=1):
            detector.check(step, s, p)
    assert detector.named == [] and detector.events == 0


@pytest.mark.parametrize("flag,value", [("max_file_mb", "0"), ("max_file_mb", "nan"), ("straggler_fraction", "-1"),
                                        ("straggler_fraction", "nan"), ("straggler_steps", "0"), ("trace_steps", "0")])
def test_bad_observability_values_are_refused_in_one_line(flag, value):
    assert_one_line_error(train_main, ["--job.config_file", "train_configs/debug_model.toml",
                                       f"--observability.{flag}", value], f"observability.{flag} = ", "is invalid")


@pytest.mark.parametrize("flag,value", [("straggler_steps", "5"), ("trace_steps", "3")])
def test_a_phase_option_without_the_phases_is_refused(flag, value):
    assert_one_line_error(train_main, ["--job.config_file", "train_configs/debug_model.toml",
                                       "--observability.no_record_phases", f"--observability.{flag}", value],
                          f"observability.{flag} = {value}", "record_phases is off")


def test_a_failing_disk_stops_the_files_with_one_warning_not_the_rank(tmp_path, caplog):
    (tmp_path / "timeline").write_text("a file where the folder should be")
    phases = record(tmp_path, [{"data": 0.0, "forward_backward": 0.001}] * 3)
    phases.write_trace()
    phases.close()
    assert len(phases.take_finished()) == 3  # still summarised
    warnings = [r for r in caplog.records if "no longer written" in r.getMessage()]
    assert len(warnings) == 1 and "rank 3" in warnings[0].getMessage()


def test_a_lag_carried_from_the_step_before_is_named_as_such():
    # Rank 1 starts every step 0.3 s late (it ends the step before late, after the last collective) and no phase
    # of the step itself makes it later: the lag is not the data phase's.
    cfg = Observability(straggler_steps=2, straggler_fraction=0.2)
    detector = StragglerDetector(cfg, ["a", "b", "c"])
    for step in (1, 2):
        starts = torch.tensor([100.0 * step, 100.0 * step + 0.3, 100.0 * step], dtype=torch.float64)
        phases = torch.full((3, len(PHASES)), 0.1, dtype=torch.float64)
        lags = detector.check(step, starts, phases)
        assert lags == pytest.approx([0.0, 0.3, 0.0])
    assert detector.named == [(1, "the previous step's last phases", 2)]
