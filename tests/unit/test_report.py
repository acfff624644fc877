"""scripts/report.py and torchtitan/report/ on synthetic run folders written as the trainer writes them
(metrics.jsonl; timeline/rank*.jsonl, plan.json, trace_rank*.json as the observability spec says): every plot's
data is the files' values, and a folder a crash or a relaunch left (files missing, a line cut short, garbage, rows
repeated or out of order, keys missing, rotated files) gives a report of what is there with one warning per
problem, never a traceback."""

import json
import random
import re
from html import escape
from pathlib import Path

import pytest

from scripts import report as report_script
from tests.bad_input import assert_one_line_error, run_entry_point, snapshot
from torchtitan.report.run_folder import RANKS_PREFIXES, read_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PHASES = ("data", "forward_backward", "grad_comm", "optimizer", "logging", "evaluation", "checkpoint")


def training_row(step: int, rng: random.Random, **extra) -> dict:
    return {"step": step, "loss": rng.uniform(2, 9), "grad_norm": rng.uniform(0.1, 3), "lr": rng.uniform(1e-5, 1e-3),
            "tps": rng.uniform(100, 5000), "tflops": 0.1, "mfu": rng.uniform(1, 60), "memory_gib": rng.uniform(0.3, 2),
            "elapsed_s": step * 0.5, "step_time_s": rng.uniform(0.05, 2), "data_time_s": rng.uniform(0, 0.05),
            "data_pct": 1.0, **extra}


def timeline_row(step: int, rank: int, rng: random.Random, memory: bool = True) -> dict:
    phases = {name: round(rng.uniform(0, 0.2), 6) for name in PHASES}
    row = {"step": step, "rank": rank, "host": "node0", "start": 1.7e9 + step, "total_s": sum(phases.values()),
           "phases": phases}
    if memory:
        row["memory"] = {"rss_gib": rng.uniform(0.3, 1), "peak_rss_gib": rng.uniform(1, 2)}
    return row


def reference_lags(rows: dict[int, dict]) -> dict[int, float]:
    """{rank: its lag} at one step from the ranks' timeline rows: the most it reaches a phase's end after the rank
    that is the median there (the lower middle one of an even count), 0 when nowhere behind."""
    ends = {rank: [row["start"] + sum(row["phases"][p] for p in PHASES[:i + 1]) for i in range(len(PHASES))]
            for rank, row in rows.items()}
    medians = [sorted(e[i] for e in ends.values())[(len(ends) - 1) // 2] for i in range(len(PHASES))]
    return {rank: max(0.0, *(e - m for e, m in zip(ends[rank], medians))) for rank in rows}


def median_lag_rank(rows: dict[int, dict]) -> int:
    lags = reference_lags(rows)
    return sorted(rows, key=lambda rank: (lags[rank], rank))[(len(rows) - 1) // 2]


def write_jsonl(path: Path, rows: list, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) + tail)


def full_run(folder: Path, seed: int, steps: int = 6, ranks: int = 2, experts: int = 4, layers: int = 2) -> dict:
    """A run folder with every kind of data the report draws (a MoE GRPO run with validation, eval and timelines,
    which no real run is, so that every plot is made); returns what was written."""
    rng = random.Random(seed)
    training = []
    for step in range(1, steps + 1):
        moe = {"moe/max_over_mean": rng.uniform(1, 2)}
        for layer in range(layers):
            shares = [rng.random() for _ in range(experts)]
            moe[f"moe/layer{layer}/max_tokens"] = max(shares) * 100
            moe[f"moe/layer{layer}/mean_tokens"] = sum(shares) / experts * 100
            moe[f"moe/layer{layer}/expert_fractions"] = [s / sum(shares) for s in shares]
        rl = {"rl/reward_mean": rng.random(), "rl/reward_std": rng.random() / 4, "rl/reward/text_shape": rng.random()}
        phase = {f"phase/total/{s}": rng.uniform(0.1, 1) for s in ("min", "median", "max")}
        memory = {f"memory/rss_gib/{s}": rng.uniform(0.3, 1) for s in ("min", "median", "max")}
        training.append(training_row(step, rng, **moe, **rl, **phase, **memory, **{"memory/plan_gib": 1.5}))
    validation = [{"step": s, "val_loss": rng.uniform(2, 9), "val_perplexity": 100.0} for s in (2, 4, 6)]
    evaluation = [{"step": s, "eval/pydocs_mc/acc": rng.random(), "eval/pydocs_mc/acc_norm": rng.random()}
                  for s in (3, 6)]
    rows = []
    for row in training:
        # As the trainer writes them: the training row, then the ranks row of the same step (phase/*, memory/*).
        ranks_keys = [k for k in row if k.startswith(RANKS_PREFIXES)]
        rows.append({k: v for k, v in row.items() if k not in ranks_keys})
        rows.append({"step": row["step"], **{k: row[k] for k in ranks_keys}})
        rows += [v for v in validation if v["step"] == row["step"]] + [e for e in evaluation if e["step"] == row["step"]]
    write_jsonl(folder / "metrics.jsonl", rows)
    timeline = {rank: [timeline_row(s, rank, rng, memory=s % 2 == 0) for s in range(1, steps + 1)]
                for rank in range(ranks)}
    for rank, trows in timeline.items():
        write_jsonl(folder / "timeline" / f"rank{rank}.jsonl", trows)
        events = [{"name": name, "ph": "X", "ts": 1e6 * (1.7e9 + r["step"]), "dur": 1e6 * secs, "pid": rank, "tid": 0,
                   "args": {"step": r["step"]}} for r in trows[-2:] for name, secs in r["phases"].items()]
        (folder / "timeline" / f"trace_rank{rank}.json").write_text(json.dumps({"traceEvents": events,
                                                                                "displayTimeUnit": "ms"}))
    plan = {"device": "CPU", "world_size": ranks, "memory_gib": {"total": 1.25, "params": 0.1}}
    (folder / "timeline" / "plan.json").write_text(json.dumps(plan))
    return {"training": training, "validation": validation, "evaluation": evaluation, "timeline": timeline}


def strict_json(text: str):
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are errors."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def plot_data(html: str) -> dict[str, dict]:
    blocks = re.findall(r'<script type="application/json" class="plot-data" data-plot="([^"]+)">(.*?)</script>', html,
                        re.S)
    return {name: strict_json(text) for name, text in blocks}


def series(data: dict, name: str) -> dict[int, object]:
    """A plot series as {step: value}, the steps it has no value at left out."""
    return {x: v for x, v in zip(data["x"], data["series"][name]) if v is not None}


def report(folder: Path, *flags: str) -> tuple[int, str]:
    return run_entry_point(report_script.main, [str(folder), *flags])


@pytest.mark.parametrize("seed, ranks", [(0, 2), (1, 3)])
def test_every_plot_draws_the_run_folders_values(tmp_path, seed, ranks):
    written = full_run(tmp_path, seed, ranks=ranks)
    code, output = report(tmp_path)
    assert code == 0, output
    assert "warning:" not in output
    html = (tmp_path / "report.html").read_text()
    data = plot_data(html)
    assert sorted(data) == sorted(["loss", "learning_rate", "grad_norm", "throughput", "step_time", "memory",
                                   "rank_lag", "phases", "moe_balance", "expert_load", "evaluation",
                                   "rl_rewards"])
    assert '<img class="plot"' in html and html.count('<img class="plot"') == 12
    training = written["training"]

    def column(key, rows=training):
        return {r["step"]: r[key] for r in rows}

    assert series(data["loss"], "loss") == column("loss")
    assert series(data["loss"], "val_loss") == column("val_loss", written["validation"])
    for name, key in [("learning_rate", "lr"), ("grad_norm", "grad_norm")]:
        assert series(data[name], key) == column(key)
    assert series(data["throughput"], "tps") == column("tps") and series(data["throughput"], "mfu") == column("mfu")
    assert series(data["step_time"], "phase/total/max") == column("phase/total/max")
    assert series(data["memory"], "memory/rss_gib/min") == column("memory/rss_gib/min")
    assert data["memory"]["plan_gib"] == 1.25  # plan.json's total, before metrics' memory/plan_gib
    steps = range(1, 7)
    lags = {step: reference_lags({rank: rows[step - 1] for rank, rows in written["timeline"].items()})
            for step in steps}
    for rank, rows in written["timeline"].items():
        assert series(data["rank_lag"], f"rank{rank}") == pytest.approx({s: lags[s][rank] for s in steps}, abs=1e-6)
        assert series(data["memory"], f"rank{rank}/peak_rss_gib") == {r["step"]: r["memory"]["peak_rss_gib"]
                                                                      for r in rows if "memory" in r}
    # The phases are those of the rank whose lag is the median at each step.
    for i, step in enumerate(data["phases"]["x"]):
        median_rank = median_lag_rank({rank: rows[step - 1] for rank, rows in written["timeline"].items()})
        assert data["phases"]["rank"][i] == median_rank
        assert {name: data["phases"]["series"][name][i] for name in PHASES} == \
            written["timeline"][median_rank][step - 1]["phases"]
    for layer in range(2):
        for expert in range(4):
            assert series(data["expert_load"], f"layer{layer}/expert{expert}") == {
                r["step"]: r[f"moe/layer{layer}/expert_fractions"][expert] for r in training}
        assert series(data["moe_balance"], f"layer{layer}") == pytest.approx(
            {r["step"]: r[f"moe/layer{layer}/max_tokens"] / r[f"moe/layer{layer}/mean_tokens"] for r in training})
    assert series(data["moe_balance"], "max_over_mean") == column("moe/max_over_mean")
    assert series(data["evaluation"], "pydocs_mc/acc") == column("eval/pydocs_mc/acc", written["evaluation"])
    assert series(data["rl_rewards"], "reward_mean") == column("rl/reward_mean")
    assert series(data["rl_rewards"], "reward/text_shape") == column("rl/reward/text_shape")
    # One PNG per plot, each a PNG; and the ranks' traces merged, every event under its rank.
    pngs = sorted((tmp_path / "report_png").iterdir())
    assert [p.stem for p in pngs] == sorted(data) and all(p.read_bytes().startswith(PNG_SIGNATURE) for p in pngs)
    trace = json.loads((tmp_path / "report.trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["pid"] for e in events}) == list(range(ranks)) and len(events) == ranks * 2 * len(PHASES)
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        f"rank {r}" for r in range(ranks)}
    # The page needs nothing beside it: no URL but its data URIs.
    assert not re.search(r'(src|href)="(?!data:)', html)


def synchronous_timelines(rng: random.Random, ranks: int, steps: int, late_rank: int, late: dict[int, float]) -> \
        dict[int, list[dict]]:
    """Timelines of a synchronous run (every rank leaves forward_backward together, after the last one's data
    came) whose ``late_rank`` waits ``late[step]`` seconds longer for its data at those steps; the ranks start
    and finish their own work within a millisecond of each other otherwise."""
    timelines = {rank: [] for rank in range(ranks)}
    for step in range(1, steps + 1):
        begin = 1.7e9 + 10 * step
        starts = [begin + rng.uniform(0, 1e-3) for _ in range(ranks)]
        data = [0.05 + rng.uniform(0, 1e-3) + (late.get(step, 0.0) if rank == late_rank else 0.0)
                for rank in range(ranks)]
        together = max(s + d for s, d in zip(starts, data)) + 0.2  # the end of forward_backward, on every rank
        for rank in range(ranks):
            phases = {"data": data[rank], "forward_backward": together - starts[rank] - data[rank], "grad_comm": 0.01,
                      "optimizer": 0.02 + rng.uniform(0, 1e-3), "logging": rng.uniform(0, 1e-3), "evaluation": 0.0,
                      "checkpoint": 0.0}
            timelines[rank].append({"step": step, "rank": rank, "host": f"node{rank}", "start": starts[rank],
                                    "total_s": sum(phases.values()), "phases": phases})
    return timelines


@pytest.mark.parametrize("seed, ranks, late_rank, missing", [(20, 2, 1, (0, 5)), (21, 3, 0, (2, 7))])
def test_the_lag_heatmap_shows_the_rank_whose_data_came_late_and_the_phases_are_a_typical_ranks(
        tmp_path, seed, ranks, late_rank, missing):
    """Every rank's step lasts as long (they wait for each other): total_s cannot show the late rank, its lag can."""
    rng = random.Random(seed)
    late = {step: rng.uniform(0.3, 1.0) for step in (3, 4, 8)}
    timelines = synchronous_timelines(rng, ranks, 9, late_rank, late)
    missing_rank, missing_step = missing
    del timelines[missing_rank][missing_step - 1]  # a step one rank's timeline lacks: no lag over all ranks
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(s, rng) for s in range(1, 10)])
    for rank, rows in timelines.items():
        write_jsonl(tmp_path / "timeline" / f"rank{rank}.jsonl", rows)
    code, output = report(tmp_path)
    assert code == 0 and "warning:" not in output, output
    html = (tmp_path / "report.html").read_text()
    data = plot_data(html)
    lag = data["rank_lag"]
    steps = [s for s in range(1, 10) if s != missing_step]
    assert lag["x"] == steps and lag["steps_left_out"] == 1 and escape("1 step that some rank's timeline lacks") in html
    for rank in range(ranks):
        expected = {s: late.get(s, 0.0) if rank == late_rank else 0.0 for s in steps}
        assert series(lag, f"rank{rank}") == pytest.approx(expected, abs=3e-3), rank
    # At the late steps the phases drawn are not the late rank's but those of a rank that waited for it, in
    # forward_backward; at the step one rank lacks, the median-lag rank of the others.
    phases = data["phases"]
    assert phases["x"] == list(range(1, 10))
    assert all(rank != late_rank for step, rank in zip(phases["x"], phases["rank"]) if step in late)
    by_rank = {rank: {row["step"]: row for row in rows} for rank, rows in timelines.items()}
    for step, rank in zip(phases["x"], phases["rank"]):
        present = {r: rows[step] for r, rows in by_rank.items() if step in rows}
        assert rank == median_lag_rank(present), step
        assert series(phases, "forward_backward")[step] == present[rank]["phases"]["forward_backward"]
    for step, delay in late.items():
        assert series(phases, "forward_backward")[step] > 0.2 + delay - 3e-3  # it waited for the late rank


@pytest.mark.parametrize("ranks, drop, note", [
    (1, None, "per-rank lag: one rank's timeline; no other rank to be behind"),
    (2, "start", "per-rank lag: no step that every rank's timeline has with its start and phases"),
])
def test_timelines_that_give_no_lag_leave_the_heatmap_out_with_a_note(tmp_path, ranks, drop, note):
    rng = random.Random(22 + ranks)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(s, rng) for s in (1, 2, 3)])
    for rank, rows in synchronous_timelines(rng, ranks, 3, 0, {2: 0.5}).items():
        write_jsonl(tmp_path / "timeline" / f"rank{rank}.jsonl", [{k: v for k, v in r.items() if k != drop}
                                                                  for r in rows])
    code, output = report(tmp_path)
    assert code == 0 and "warning:" not in output, output
    html = (tmp_path / "report.html").read_text()
    assert f"<li>{escape(note)}</li>" in html
    assert "rank_lag" not in plot_data(html) and plot_data(html)["phases"]["rank"] == [0, 0, 0]


def test_a_folder_without_timelines_or_extras_lists_what_is_left_out(tmp_path):
    rng = random.Random(2)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(s, rng, mfu=None) for s in (1, 2, 3)])
    code, output = report(tmp_path)
    assert code == 0 and "warning:" not in output, output
    html = (tmp_path / "report.html").read_text()
    assert sorted(plot_data(html)) == ["grad_norm", "learning_rate", "loss", "memory", "step_time", "throughput"]
    absent = re.search(r'<section id="absent">(.*?)</section>', html, re.S).group(1)
    for what in ("validation loss", "MFU", "memory plan", "per-rank lag", "phase breakdown", "MoE balance",
                 "MoE expert load", "evaluation scores", "RL rewards"):
        assert f"<li>{what}: " in absent, what
    assert not (tmp_path / "report.trace.json").exists()
    assert series(plot_data(html)["throughput"], "tps") and "mfu" not in plot_data(html)["throughput"]["series"]


def problems_of(folder: Path) -> list[str]:
    return [str(p) for p in read_run(folder).problems]


@pytest.mark.parametrize("tail, line", [('{"step": 4, "loss": 3.', 4), ('{"step"', 4)])
def test_a_last_line_cut_short_is_one_warning_and_the_rows_before_it_are_kept(tmp_path, tail, line):
    rng = random.Random(3)
    rows = [training_row(s, rng) for s in (1, 2, 3)]
    write_jsonl(tmp_path / "metrics.jsonl", rows, tail=tail)
    write_jsonl(tmp_path / "timeline" / "rank0.jsonl", [timeline_row(s, 0, rng) for s in (1, 2)],
                tail='{"step": 3, "rank": 0, "tot')
    run = read_run(tmp_path)
    assert [r["step"] for r in run.training] == [1, 2, 3] and [r["step"] for r in run.timeline[0]] == [1, 2]
    assert problems_of(tmp_path) == [
        f"metrics.jsonl:{line}: the last line is cut short (the run stopped while writing it?); skipped",
        "timeline/rank0.jsonl:3: the last line is cut short (the run stopped while writing it?); skipped"]


def test_garbage_lines_and_rows_without_a_step_are_one_warning_each(tmp_path):
    rng = random.Random(4)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(1, rng), "#### not json", "[1, 2]", training_row(2, rng),
                                             {"loss": 3.0}, {"step": "3", "loss": 3.0}, "", training_row(4, rng),
                                             {"step": 5, "note": "x"}])
    assert [r["step"] for r in read_run(tmp_path).training] == [1, 2, 4]
    assert problems_of(tmp_path) == [
        "metrics.jsonl:2: not JSON; skipped",
        "metrics.jsonl:3: a JSON list, not an object; skipped",
        "metrics.jsonl:5: no integer \"step\" (found None); skipped",
        "metrics.jsonl:6: no integer \"step\" (found '3'); skipped",
        "metrics.jsonl:9: note is 'x', not a number; left out",
        "metrics.jsonl:9: neither a training, validation, eval nor ranks row (keys: step); skipped"]


def test_a_row_cut_short_with_a_relaunchs_row_appended_on_its_line_keeps_the_appended_row(tmp_path):
    rng = random.Random(5)
    first = [training_row(s, rng) for s in (1, 2, 3)]
    again = [training_row(s, rng) for s in (3, 4)]
    cut = json.dumps(training_row(4, rng))[:25]
    write_jsonl(tmp_path / "metrics.jsonl", [*first, cut + json.dumps(again[0]), again[1]])
    run = read_run(tmp_path)
    assert [r["loss"] for r in run.training] == [first[0]["loss"], first[1]["loss"], again[0]["loss"],
                                                 again[1]["loss"]]
    assert problems_of(tmp_path) == [
        "metrics.jsonl:4: a row cut short, with another appended after it (a crash, then a relaunch); the cut part is "
        "skipped",
        "metrics.jsonl:4: training rows of step 3 logged again (a relaunch resuming from an earlier step?); the later "
        "rows are used"]


@pytest.mark.parametrize("launches, expected", [
    ([range(1, 6), range(3, 8)], ["metrics.jsonl:6: training rows of step 3-5 logged again (a relaunch resuming "
                                  "from an earlier step?); the later rows are used"]),
    ([range(1, 5), range(2, 6), range(4, 7)], [
        "metrics.jsonl:5: training rows of step 2-4 logged again (a relaunch resuming from an earlier step?); the "
        "later rows are used",
        "metrics.jsonl:9: training rows of step 4-5 logged again (a relaunch resuming from an earlier step?); the "
        "later rows are used"]),
])
def test_relaunches_appending_are_one_warning_each_and_the_later_row_of_a_step_wins(tmp_path, launches, expected):
    rng = random.Random(6)
    rows = [training_row(s, rng) for launch in launches for s in launch]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    latest = {r["step"]: r for r in rows}
    assert read_run(tmp_path).training == [latest[s] for s in sorted(latest)]
    assert problems_of(tmp_path) == expected


@pytest.mark.parametrize("resume_from, expected", [
    (2, "metrics.jsonl:7: training and validation rows of step 2-4 logged again (a relaunch resuming from an earlier "
        "step?); the later rows are used"),
    (4, "metrics.jsonl:7: training and validation rows of step 4 logged again (a relaunch resuming from an earlier "
        "step?); the later rows are used"),
])
def test_a_relaunch_repeating_training_and_validation_rows_is_one_warning(tmp_path, resume_from, expected):
    rng = random.Random(14)
    rows = []
    for launch in (range(1, 5), range(resume_from, 7)):
        for step in launch:
            rows.append(training_row(step, rng))
            if step % 2 == 0:
                rows.append({"step": step, "val_loss": rng.random()})
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    run = read_run(tmp_path)
    assert run.validation == [[r for r in rows if r.get("val_loss") and r["step"] == s][-1] for s in (2, 4, 6)]
    assert problems_of(tmp_path) == [expected]


@pytest.mark.parametrize("order, expected", [
    ([1, 2, 5, 3, 4, 6], "metrics.jsonl:4: training rows of step 3-4 come after later steps (out of order); sorted "
                         "by step"),
    ([4, 1, 2, 3], "metrics.jsonl:2: training rows of step 1-3 come after later steps (out of order); sorted by step"),
])
def test_rows_out_of_order_are_one_warning_and_sorted(tmp_path, order, expected):
    rng = random.Random(7)
    rows = [training_row(s, rng) for s in order]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    assert read_run(tmp_path).training == sorted(rows, key=lambda r: r["step"])
    assert problems_of(tmp_path) == [expected]


def test_validation_rows_at_a_training_step_are_no_repeat(tmp_path):
    rng = random.Random(8)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(1, rng), training_row(2, rng), {"step": 2, "val_loss": 3.0},
                                             {"step": 2, "eval/x/acc": 0.5}])
    run = read_run(tmp_path)
    assert (len(run.training), len(run.validation), len(run.evaluation), run.problems) == (2, 1, 1, [])


def test_rows_missing_keys_or_with_values_not_numbers_are_one_warning_per_key(tmp_path):
    rng = random.Random(9)
    rows = [training_row(s, rng) for s in range(1, 7)]
    for row in rows[1:4]:
        del row["grad_norm"]
    del rows[4]["lr"]
    rows[2]["loss"] = rows[5]["loss"] = "nan?"
    rows[3]["tps"] = {"a": "b"}
    rows[0]["loss"] = float("nan")  # a number (a step the guard skipped): no problem, a gap in the line
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    assert problems_of(tmp_path) == [
        "metrics.jsonl:2: 3 training rows (step 2-4) without grad_norm; their other values are used",
        "metrics.jsonl:3: loss is 'nan?', not a number (and in 1 more rows); left out",
        "metrics.jsonl:4: tps is {'a': 'b'}, not a number; left out",
        "metrics.jsonl:5: 1 training row (step 5) without lr; their other values are used"]
    code, output = report(tmp_path)
    assert code == 0, output
    data = plot_data((tmp_path / "report.html").read_text())
    assert series(data["grad_norm"], "grad_norm") == {r["step"]: r["grad_norm"] for r in rows if "grad_norm" in r}
    assert sorted(series(data["loss"], "loss")) == [2, 4, 5]
    assert sorted(series(data["throughput"], "tps")) == [1, 2, 3, 5, 6]


@pytest.mark.parametrize("files", [
    {"rank0.jsonl.1": [1, 2, 3], "rank0.jsonl": [4, 5]},
    {"rank0.jsonl.2": [1, 2], "rank0.jsonl.1": [3, 4], "rank0.jsonl": [5]},
])
def test_rotated_timeline_files_are_read_oldest_first(tmp_path, files):
    rng = random.Random(10)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(1, rng)])
    written = {}
    for name, steps in files.items():
        rows = [timeline_row(s, 0, rng) for s in steps]
        written.update({r["step"]: r for r in rows})
        write_jsonl(tmp_path / "timeline" / name, rows)
    run = read_run(tmp_path)
    assert run.timeline[0] == [written[s] for s in range(1, 6)] and run.problems == []


@pytest.mark.parametrize("ranks, world_size, expected", [
    ([0, 2], None, "timeline: no timeline file for rank 1 of 3 ranks; left out"),
    ([0, 1], 4, "timeline: no timeline file for rank 2-3 of 4 ranks; left out"),
])
def test_a_rank_without_a_timeline_file_is_one_warning(tmp_path, ranks, world_size, expected):
    rng = random.Random(11)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(1, rng)])
    for rank in ranks:
        write_jsonl(tmp_path / "timeline" / f"rank{rank}.jsonl", [timeline_row(1, rank, rng)])
    if world_size:
        (tmp_path / "timeline" / "plan.json").write_text(json.dumps({"world_size": world_size,
                                                                     "memory_gib": {"total": 1.0}}))
    run = read_run(tmp_path)
    assert sorted(run.timeline) == ranks and problems_of(tmp_path) == [expected]


def test_unreadable_plan_and_traces_are_warnings_and_the_report_is_still_written(tmp_path):
    full_run(tmp_path, seed=12, ranks=3)
    (tmp_path / "timeline" / "plan.json").write_text('{"device": "CPU", "memory_gib": {"to')
    (tmp_path / "timeline" / "trace_rank1.json").write_text("[not json")
    (tmp_path / "timeline" / "trace_rank2.json").write_text('{"events": []}')
    with open(tmp_path / "timeline" / "rank2.jsonl", "a") as f:
        f.write(json.dumps({"step": 7, "rank": 2}) + "\n")
    code, output = report(tmp_path)
    assert code == 0, output
    warnings = [line for line in output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: timeline/plan.json:1: not JSON (Unterminated string starting at); left out",
        "warning: timeline/rank2.jsonl:7: no total_s number; the row is skipped",
        "warning: timeline/trace_rank1.json:1: not JSON (Expecting value); left out",
        "warning: timeline/trace_rank2.json: no traceEvents list; left out"]
    html = (tmp_path / "report.html").read_text()
    assert all(f"<li>{w.removeprefix('warning: ')}</li>" in html for w in warnings)
    data = plot_data(html)
    assert data["memory"]["plan_gib"] == 1.5  # metrics' memory/plan_gib, plan.json being unreadable
    trace = json.loads((tmp_path / "report.trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0}


@pytest.mark.parametrize("make, needle", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("x"), "is a file"),
    (lambda p: p.mkdir(), "holds no metrics.jsonl"),
])
def test_a_missing_run_folder_or_metrics_file_is_one_error_line(tmp_path, make, needle):
    folder = tmp_path / "run"
    make(folder)
    assert_one_line_error(report_script.main, [str(folder)], "RUN_FOLDER", needle)


def test_reports_replace_their_own_files_and_never_another(tmp_path):
    full_run(tmp_path, seed=13)
    assert report(tmp_path)[0] == 0
    # Again, after the run went on without its timelines: the PNGs of plots now gone go too.
    for path in (tmp_path / "timeline").iterdir():
        path.unlink()
    code, output = report(tmp_path)
    assert code == 0, output
    pngs = {p.stem for p in (tmp_path / "report_png").iterdir()}
    assert pngs == set(plot_data((tmp_path / "report.html").read_text())) and "rank_lag" not in pngs
    assert not (tmp_path / "report.trace.json").exists()
    # A file this script did not write, or edited since, is never replaced.
    foreign = tmp_path / "other"
    foreign.mkdir()
    (foreign / "mine.html").write_text("<p>mine</p>")
    (foreign / "pngs").mkdir()
    (foreign / "pngs" / "loss.png").write_bytes(PNG_SIGNATURE + b"someone else's")
    edited = tmp_path / "report.html"
    edited.write_text(edited.read_text().replace("Loss", "Lost"))
    before = snapshot(foreign, edited)
    assert_one_line_error(report_script.main, [str(tmp_path), "--out", str(foreign / "mine.html")], "--out",
                          "was not written by this script", unchanged=before)
    assert_one_line_error(report_script.main, [str(tmp_path), "--out", str(foreign / "new.html"), "--png_dir",
                                               str(foreign / "pngs")], "--png_dir", "loss.png", unchanged=before)
    assert_one_line_error(report_script.main, [str(tmp_path)], "edited since", unchanged=before)


@pytest.mark.parametrize("steps, ranks, cells", [(1000, 2, None), (450, 20, 2000)])
def test_long_runs_draw_an_even_sample_of_steps_in_their_heatmaps_with_the_values_of_those_steps(
        tmp_path, monkeypatch, steps, ranks, cells):
    from torchtitan.report import figures
    from torchtitan.report.figures import MAX_COLUMNS, make_plots

    if cells:  # many ranks: fewer steps, the cells of the heatmap bounded
        monkeypatch.setattr(figures, "MAX_CELLS", cells)
    rng = random.Random(steps)
    write_jsonl(tmp_path / "metrics.jsonl", [training_row(s, rng) for s in range(1, steps + 1, 50)])
    data_s = {}
    for rank in range(ranks):
        rows = [{"step": s, "rank": rank, "start": 1.7e9 + s, "total_s": 0.0, "phases": {"data": rng.random()}}
                for s in range(1, steps + 1)]
        data_s[rank] = {r["step"]: r["phases"]["data"] for r in rows}
        write_jsonl(tmp_path / "timeline" / f"rank{rank}.jsonl", rows)
    # One phase and one start: a rank's lag is its data time less the (lower) median rank's.
    lags = {rank: {s: max(0.0, data_s[rank][s] - sorted(d[s] for d in data_s.values())[(ranks - 1) // 2])
                   for s in data_s[rank]} for rank in range(ranks)}
    plots, _ = make_plots(read_run(tmp_path))
    data = next(p.data for p in plots if p.name == "rank_lag")
    assert len(data["x"]) == min(MAX_COLUMNS, figures.MAX_CELLS // ranks) and data["x"][0] == 1
    assert data["x"][-1] == steps and data["steps_in_run"] == steps
    steps_apart = {b - a for a, b in zip(data["x"], data["x"][1:])}
    assert max(steps_apart) - min(steps_apart) <= 1  # evenly spaced
    for rank in range(ranks):
        assert series(data, f"rank{rank}") == pytest.approx({s: lags[rank][s] for s in data["x"]}, abs=1e-6)
    assert len(next(p.data for p in plots if p.name == "phases")["x"]) == MAX_COLUMNS


@pytest.mark.parametrize("layers, lines", [(3, ["max_over_mean", "layer0", "layer1", "layer2"]),
                                           (12, ["max_over_mean", "busiest layer"])])
def test_moe_balance_draws_each_layer_or_for_many_layers_the_busiest(tmp_path, layers, lines):
    from torchtitan.report.figures import make_plots

    rng = random.Random(layers)
    rows = []
    for step in (1, 2, 3):
        moe = {"moe/max_over_mean": rng.uniform(1, 2)}
        for layer in range(layers):
            moe[f"moe/layer{layer}/max_tokens"] = rng.uniform(20, 40)
            moe[f"moe/layer{layer}/mean_tokens"] = 16.0
        rows.append(training_row(step, rng, **moe))
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    plots, _ = make_plots(read_run(tmp_path))
    data = next(p.data for p in plots if p.name == "moe_balance")
    assert list(data["series"]) == lines
    ratios = [[r[f"moe/layer{layer}/max_tokens"] / 16.0 for layer in range(layers)] for r in rows]
    if layers > 8:
        assert data["series"]["busiest layer"] == [max(step) for step in ratios]
    else:
        assert data["series"]["layer1"] == [step[1] for step in ratios]


def test_a_ranks_row_without_its_training_row_is_one_warning(tmp_path):
    rows = [{"step": 1, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tps": 10.0, "memory_gib": 1.0},
            {"step": 1, "phase/total/min": 0.5, "phase/total/median": 0.6, "phase/total/max": 0.7},
            {"step": 3, "phase/total/min": 0.5}, {"step": 4, "memory/rss_gib/max": 1.0}]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    code, output = report(tmp_path)
    assert code == 0, output
    assert [line for line in output.splitlines() if line.startswith("warning:")] == [
        "warning: metrics.jsonl: 2 ranks rows (step 3-4) without the training row of their step; skipped"]
    assert series(plot_data((tmp_path / "report.html").read_text())["step_time"], "phase/total/max") == {1: 0.7}
