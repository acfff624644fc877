"""scripts/report.py on three real runs (the debug model with validation, the MoE debug model, a GRPO run), each
page rendered by headless Chromium: every picture decodes, the page's own check reports no error, the console stays
silent, and every plot's embedded data is metrics.jsonl's values; the PNGs are PNGs.

Debian's `chromium` package is the browser (.ci/run installs it); where none is found the tests skip, saying so.
"""

import json
import re
import shutil
import subprocess

import pytest

from scripts import report as report_script
from tests.bad_input import run_entry_point
from tests.conftest import REPO, run_module

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# The smallest runs that still log what each report draws: 4 steps with validation at steps 2 and 4,
# 3 MoE steps, 2 GRPO steps of 4 prompts x 4 completions.
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--checkpoint.no_enable",
         "--metrics.log_freq", "1"]
RUNS = {
    # Downstream evaluation's plot is checked on synthetic rows (tests/unit/test_report.py): lm-eval's import and
    # tasks would double this run's time.
    "dense": ["--job.config_file", "train_configs/debug_model.toml", *SMALL, "--training.steps", "4",
              "--validation.enable", "--validation.freq", "2", "--validation.steps", "1", "--validation.seq_len", "64",
              "--validation.local_batch_size", "2"],
    "moe": ["--job.config_file", "train_configs/qwen3_moe_debug.toml", *SMALL, "--training.steps", "3"],
    "rl": ["--job.config_file", "train_configs/grpo_debug.toml", "--checkpoint.no_enable", "--training.steps", "2",
           "--training.seq_len", "96", "--training.local_batch_size", "8", "--rl.prompts_per_step", "4",
           "--rl.group_size", "4", "--rl.max_new_tokens", "6", "--rl.rewards", "text_shape", "--rl.reward_weights",
           "1.0", "--rl.reward_workers", "0", "--experimental.custom_import", "tests.rl_doubles"],
}
COMMON_PLOTS = {"loss", "learning_rate", "grad_norm", "throughput", "step_time", "memory"}
EXPECTED_PLOTS = {"dense": COMMON_PLOTS, "moe": COMMON_PLOTS | {"moe_balance", "expert_load"},
                  "rl": COMMON_PLOTS | {"rl_rewards"}}
# One process each: the lag heatmap (rank_lag) needs two ranks to compare and is left out, with a note.
TIMELINE_PLOTS = {"phases"}


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


# Module-scoped: the suite's scheduler (tests/conftest.py) keeps a module that shares fixtures on one worker, so the
# runs are trained once.
@pytest.fixture(scope="module")
def browser():
    path = find_browser()
    if path is None:
        pytest.skip("no headless browser (install Debian's chromium)")
    return path


@pytest.fixture(scope="module")
def reported_runs(tmp_path_factory):
    """{name: run folder} of the three runs, each trained in its own process and reported."""
    root = tmp_path_factory.mktemp("report_runs")
    folders = {}
    for name, flags in RUNS.items():
        folder = root / name
        # PYTHONPATH: this checkout's torchtitan, whichever one is installed.
        done = run_module("torchtitan.train", *flags, "--job.dump_folder", str(folder), env={"PYTHONPATH": str(REPO)})
        assert done.returncode == 0, f"{name}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        code, output = run_entry_point(report_script.main, [str(folder)])
        assert code == 0 and "warning:" not in output, output
        folders[name] = folder
    return folders


def rendered_dom(browser: str, page, profile, *extra: str) -> tuple[str, str]:
    """(the DOM after the page's load handlers ran, the browser's log) of a headless Chromium."""
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--enable-logging=stderr", "--v=0", *extra, "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def plot_blocks(dom: str) -> dict[str, dict]:
    blocks = re.findall(r'<script type="application/json" class="plot-data" data-plot="([^"]+)">(.*?)</script>', dom,
                        re.S)
    return {name: json.loads(text) for name, text in blocks}


def series(data: dict, name: str) -> dict[int, object]:
    return {x: v for x, v in zip(data["x"], data["series"][name]) if v is not None}


def column(rows: list[dict], key: str) -> dict[int, object]:
    return {row["step"]: row[key] for row in rows if row.get(key) is not None}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_the_report_renders_in_a_headless_browser_and_draws_metrics_jsonl(browser, reported_runs, tmp_path, name):
    folder = reported_runs[name]
    dom, log = rendered_dom(browser, folder / "report.html", tmp_path / "profile")
    expected = EXPECTED_PLOTS[name] | (TIMELINE_PLOTS if (folder / "timeline").is_dir() else set())
    assert f'data-rendered="{len(expected)} plots"' in dom, re.findall(r"data-rendered=\"[^\"]*\"", dom)
    assert '<ul id="report-errors"></ul>' in dom
    if (folder / "timeline").is_dir():
        assert "<li>per-rank lag: one rank's timeline; no other rank to be behind</li>" in dom
    assert [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line] == []
    data = plot_blocks(dom)
    assert set(data) == expected
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in rows if "loss" in r]
    assert series(data["loss"], "loss") == column(training, "loss")
    assert series(data["learning_rate"], "lr") == column(training, "lr")
    assert series(data["grad_norm"], "grad_norm") == column(training, "grad_norm")
    assert series(data["throughput"], "tps") == column(training, "tps")
    assert series(data["step_time"], "step_time_s") == column(training, "step_time_s")
    if name == "dense":
        assert len(series(data["loss"], "val_loss")) == 2
        assert series(data["loss"], "val_loss") == column(rows, "val_loss")
        assert "evaluation" not in data
    if name == "moe":
        layers = sorted({int(m.group(1)) for key in training[0] if (m := re.fullmatch(r"moe/layer(\d+)/expert_"
                                                                                           r"fractions", key))})
        assert layers == [0, 1, 2, 3]
        for layer in layers:
            shares = {r["step"]: r[f"moe/layer{layer}/expert_fractions"] for r in training}
            for expert in range(8):
                assert series(data["expert_load"], f"layer{layer}/expert{expert}") == {
                    step: s[expert] for step, s in shares.items()}
        assert series(data["moe_balance"], "max_over_mean") == column(training, "moe/max_over_mean")
    if name == "rl":
        assert series(data["rl_rewards"], "reward_mean") == column(training, "rl/reward_mean")
        assert series(data["rl_rewards"], "reward/text_shape") == column(training, "rl/reward/text_shape")
    pngs = sorted((folder / "report_png").iterdir())
    assert {p.stem for p in pngs} == expected
    assert all(p.suffix == ".png" and p.stat().st_size > 1000 and p.read_bytes().startswith(PNG_SIGNATURE)
               for p in pngs)


@pytest.mark.slow
def test_a_screenshot_of_the_moe_report(browser, reported_runs, tmp_path):
    """The whole page drawn (what the note shows): a PNG of the window."""
    shot = tmp_path / "moe_report.png"
    rendered_dom(browser, reported_runs["moe"] / "report.html", tmp_path / "profile", f"--screenshot={shot}",
                 "--window-size=1100,4200", "--hide-scrollbars")
    assert shot.read_bytes().startswith(PNG_SIGNATURE) and shot.stat().st_size > 50_000
