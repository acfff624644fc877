"""scripts/gpu_check.py on a CPU: the plan it prints without a GPU, the memory sizing of the throughput rows, the
budget, the runner (a failing part, an overrunning one with a child of its own, a skipped one, the report rewritten
as results come) and the readers of the benchmarks' rows."""

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from scripts import gpu_check as gc
from scripts import gpu_check_parts as gp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "total_gib": 79.1, "free_gib": 78.6}
A100_40 = {"name": "NVIDIA A100-SXM4-40GB", "capability": [8, 0], "total_gib": 39.4, "free_gib": 39.0}
PACKAGES = {"torchao": {"version": "0.17.0"}, "pytest": {"version": "8.3.0"}, "pytest-xdist": {"version": "3.6.1"},
            "fla-core": {"error": "ModuleNotFoundError: No module named 'fla'"}}


def machine(*gpus, packages=PACKAGES) -> gp.Machine:
    return gp.Machine(sys.executable, dict(os.environ), {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0",
                                                         "gpus": list(gpus), "packages": packages})


def test_without_a_gpu_it_prints_the_plan_exits_0_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["scripts/gpu_check.sh", "--out", str(out)], cwd=REPO,
                            env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("No CUDA GPU here") and lines[1].startswith("GPU check plan: budget 480 s;")
    titles = ["CUDA tier", "dense throughput", "MoE throughput", "fla against the chunked kernel",
              "NCCL, two processes"]
    for number, title in enumerate(titles, 1):
        assert sum(line.startswith(f"  {number}. {title}: ") for line in lines) == 1, result.stdout
    assert "pytest -m cuda tests/cuda" in result.stdout and "benchmarks/gpu_throughput.py" in result.stdout
    assert lines[-1] == f"report: {out}/gpu_check_<gpu>_{time.strftime('%Y-%m-%d', time.gmtime())}.md"
    # Every part gets its reserve.
    assert all(line.endswith(f": limit {p.reserve:.0f} s (skipped with under {p.minimum:.0f} s left)")
               for line, p in zip(lines[3:8], gc.PARTS))
    assert not out.exists()


def test_a_short_budget_keeps_the_first_parts():
    lines = gc.plan_lines(gc.PARTS, None, 200, Path("/tmp/r.md"))
    assert lines[2].endswith(": limit 150 s (skipped with under 60 s left)")
    assert all(line.endswith(f": skipped: 20 s left, needs at least {p.minimum:.0f} s")
               for line, p in zip(lines[3:7], gc.PARTS[1:]))


def test_a_bad_budget_is_one_line():
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--budget", "-5"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "error: --budget -5 is invalid; it must be a finite number > 0 (seconds)" in result.stderr


def test_the_memory_model_gives_back_the_measured_peaks():
    """8 layers of the 8B widths peaked at 44.2-45.9 GiB compiled, 4 layers of 30B-A3B's at 53.6 (H200, H100)."""
    dense, moe = gp.size_rows(gp.DENSE, 139.0), gp.size_rows(gp.MOE, 139.0)
    assert (dense.layers, dense.seq_len, moe.layers, moe.seq_len) == (8, 8192, 4, 8192)
    assert 45.9 <= dense.estimate_gib <= 47.0 and abs(moe.estimate_gib - 53.6) < 0.5


@pytest.mark.parametrize("gpu, dense, moe", [(H100, (8, 8192), (4, 8192)), (A100_40, (4, 8192), (1, 8192)),
                                             ({"free_gib": 44.4}, (5, 8192), (2, 8192)),
                                             ({"free_gib": 23.0}, None, None)])
def test_rows_are_sized_to_the_free_memory(gpu, dense, moe):
    for model, expected in ((gp.DENSE, dense), (gp.MOE, moe)):
        sized = gp.size_rows(model, gpu["free_gib"])
        assert (sized and (sized.layers, sized.seq_len)) == expected
        if sized:
            assert sized.estimate_gib <= gp.usable_gib(gpu["free_gib"])


def test_sizes_grow_with_memory_and_always_fit():
    previous = (0, 0)
    for free in range(16, 200):
        sized = gp.size_rows(gp.DENSE, free)
        if sized:
            assert sized.estimate_gib <= gp.usable_gib(free)
            assert (sized.seq_len, sized.layers) >= previous
            previous = (sized.seq_len, sized.layers)
    assert previous == (8192, 8)


def test_parts_that_do_not_apply_give_their_time_to_the_first():
    lines = gc.plan_lines(gc.PARTS, machine(H100), 480, REPO / "benchmarks" / "results" / "x.md")
    text = "\n".join(lines)
    assert "  1. CUDA tier: pytest -m cuda" in text and ": limit 230 s" in lines[2]  # 450 - 130 - 90
    assert "8 layers x 8192 tokens (estimated peak 46.2 GiB of 78.6 GiB free)" in lines[3]
    assert "compiled and compiled + float8 tensorwise" in lines[3] and "4 layers x 8192 tokens" in lines[4]
    assert lines[5].endswith("skipped: fla is not importable (ModuleNotFoundError: No module named 'fla')")
    assert lines[6].endswith("skipped: this machine has 1 GPU") and lines[-1] == "report: benchmarks/results/x.md"
    two = gc.plan_lines(gc.PARTS, machine(A100_40, A100_40), 960, Path("/tmp/y.md"))
    # Twice the default budget: twice every reserve (930 - 260 - 180 - 80 to the first); no float8 before sm89.
    assert "limit 410 s" in two[2] and "limit 260 s" in two[3] and "limit 80 s" in two[6]
    assert "gpu_throughput.py compiled, 4 layers" in two[3]


def test_time_a_part_leaves_goes_to_the_next_and_a_short_budget_drops_the_last():
    assert gc.time_limit(left=450, reserve=150, later_reserves=300) == 150
    assert gc.time_limit(left=400, reserve=130, later_reserves=170) == 230  # 100 s saved before
    assert gc.time_limit(left=100, reserve=130, later_reserves=170) == 100
    assert gc.time_limit(left=20, reserve=90, later_reserves=80) == 20


def fake_part(title, code, reserve=1.0, minimum=0.5, skip=None):
    def figures(m, work, output):
        return [f"> {line}" for line in output.splitlines() if line.startswith(("# GPU", "| "))], []

    return gp.Part(title, lambda m: title, reserve, minimum, lambda m: skip,
                   lambda m, work: [sys.executable, "-c", code], figures)


def test_each_part_is_recorded_and_the_next_one_runs(tmp_path):
    report_path, pid_file = tmp_path / "report.md", tmp_path / "child.pid"
    overrun = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
               f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', "
               "flush=True); time.sleep(60)")
    parts = [fake_part("fails", "import sys; print('one'); print('two'); sys.exit(3)", reserve=2),
             fake_part("overruns", overrun, reserve=1.5),
             fake_part("not here", "raise SystemExit(1)", skip="not on this machine"),
             fake_part("reads the report", f"print(open({str(report_path)!r}).read())"),
             fake_part("too long", "pass", minimum=100)]
    report = gc.Report(report_path, parts, machine(H100), 4, ["--budget", "4"])
    start = time.monotonic()
    assert gc.run_parts(parts, report.machine, report, start + 4, tmp_path / "logs") is False
    assert time.monotonic() - start < 3.5
    statuses = [r.status for r in report.results]
    assert statuses[:4] == ["failed: exit 3", "over its time limit (2 s), stopped", "skipped: not on this machine",
                            "passed"]
    assert statuses[4].startswith("skipped: 2 s of the budget left, it needs at least 100")
    assert report.results[0].tail == ["one", "two"] and report.results[1].tail == ["started"]
    # The report was on disk, with the earlier results, while the fourth part ran.
    seen = "\n".join(report.results[3].lines)
    assert "| 1 | fails | 2 | " in seen and "| failed: exit 3 |" in seen and "| 4 | reads the report | 1 |" in seen
    text = report_path.read_text()
    assert "## 1. fails: failed: exit 3" in text and "```\none\ntwo\n```" in text and "| 5 | too long | n/a |" in text
    # The overrunning part's own child went with it.
    state = Path(f"/proc/{pid_file.read_text()}/status")
    assert not state.exists() or "zombie" in state.read_text()


def test_a_run_where_everything_that_ran_passed(tmp_path):
    parts = [fake_part("passes", "print('fine')"), fake_part("not here", "pass", skip="one GPU")]
    report = gc.Report(tmp_path / "r.md", parts, machine(H100), 10, [])
    assert gc.run_parts(parts, report.machine, report, time.monotonic() + 10, tmp_path) is True
    assert [r.status for r in report.results] == ["passed", "skipped: one GPU"]


XDIST_OUTPUT = """\
[gw0] [ 33%] PASSED tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[eager]
[gw1] [ 66%] FAILED tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[chunked_loss]
[gw0] [100%] SKIPPED tests/cuda/test_cuda_gated_delta_rule.py::test_fla_equals_the_chunked_form
============================= slowest durations =============================
41.20s call     tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[chunked_loss]
12.03s call     tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[eager]
=========================== short test summary info ===========================
SKIPPED [1] tests/cuda/test_cuda_gated_delta_rule.py:17: flash-linear-attention (the fla extra) is not installed
FAILED tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[chunked_loss] - AssertionError: [7.6]
============= 1 failed, 1 passed, 1 skipped in 55.12s =============
"""
PLAIN_OUTPUT = """\
tests/cuda/test_cuda_chunked_loss.py::test_the_compiled_chunk_loop_equals_the_plain_path PASSED          [ 50%]
tests/cuda/test_cuda_optimizer_step.py::test_host_parameters_with_a_gpu_norm_are_clipped_as_clipping_first PASSED [100%]
"""


def test_pytest_outcomes_times_and_reasons_are_read_from_its_output():
    lines, problems = gp.pytest_figures(XDIST_OUTPUT)
    assert lines[0] == "pytest: 1 failed, 1 passed, 1 skipped in 55.12s"
    assert "| `tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[eager]` | PASSED | 12.0 |" in lines
    assert any(line.startswith("- FAILED tests/cuda/test_cuda_tier.py") for line in lines)
    assert any("- SKIPPED [1]" in line and "not installed" in line for line in lines)
    assert problems == ["tests/cuda/test_cuda_tier.py::test_the_debug_model_learns_on_the_gpu[chunked_loss] FAILED"]
    # Cut short, without xdist: the outcomes so far, no summary line.
    lines, problems = gp.pytest_figures(PLAIN_OUTPUT)
    assert lines[0] == "pytest: no summary line (cut short?)" and problems == []
    assert sum(line.endswith("| PASSED | n/a |") for line in lines) == 2


def test_the_cuda_tier_runs_one_pytest_worker_per_26_gib():
    assert gp.cuda_tier_command(machine(H100), Path("/w"))[-2:] == ["-n", str(min(3, os.cpu_count()))]
    assert gp.cuda_tier_command(machine(A100_40), Path("/w"))[-2:] == ["-n", "0"]
    no_xdist = {**PACKAGES, "pytest-xdist": {"error": "ModuleNotFoundError"}}
    assert gp.cuda_tier_command(machine(H100, packages=no_xdist), Path("/w"))[-2:] == ["-o", "addopts=-ra"]


@pytest.mark.parametrize("gpu, name", [(H100, "gpu_check_h100_80gb_hbm3_2026-12-01.md"),
                                       (A100_40, "gpu_check_a100_sxm4_40gb_2026-12-01.md")])
def test_the_report_is_named_after_the_gpu_and_the_day(gpu, name):
    import datetime

    assert gc.report_name(gpu["name"], datetime.date(2026, 12, 1)) == name


def test_dense_rows_missing_failed_or_without_mfu_are_reported(tmp_path):
    from gpu_throughput import table_row

    rows = [{"configuration": "compiled", "layers": 8, "seq_len": 8192, "tps": 31634.2, "mfu": None,
             "memory_gib": 44.2, "loss": 8.549}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines, problems = gp.dense_figures(machine(H100), tmp_path, "")
    assert "| compiled | 31,634 | n/a | 44.2 | 8.549 |" in lines
    assert "| compiled + float8 tensorwise | not measured | | | |" in lines
    assert problems == ["compiled + float8 tensorwise: not measured"]
    assert table_row("compiled", rows[0]) == "| compiled | 31,634 | n/a | 44.2 | 8.549 |"  # gpu_throughput's own
    with open(tmp_path / "rows.jsonl", "a") as f:
        f.write(json.dumps({"configuration": "compiled + float8 tensorwise", "error": "CUDA out of memory"}) + "\n")
    lines, problems = gp.dense_figures(machine(A100_40), tmp_path, "")
    assert "| compiled + float8 tensorwise |" not in "\n".join(lines) and problems == []  # not asked for on sm80
    assert lines[-1].startswith("float8 left out")
    assert gp.dense_figures(machine(H100), tmp_path, "")[1] == ["compiled + float8 tensorwise: CUDA out of memory"]


def test_moe_rows_from_benchmarks_moe_are_read(tmp_path):
    import moe

    path = tmp_path / "rows.jsonl"
    moe.expert_rows("debugmodel", 4, 16, 8, 64, torch.device("cpu"), 1, path)
    lines, problems = gp.moe_figures(machine(H100), tmp_path, "")
    assert problems == ["no one-GPU row measured"]
    assert any(line.startswith("| debugmodel (4 x 16 x 8) | float32 | 64 | ") for line in lines)
    with open(path, "a") as f:
        f.write(json.dumps({"section": "gpu", "mode": "compiled", "layers": 4, "seq_len": 8192, "tps": 48171.0,
                            "mfu": 23.6, "memory_gib": 53.6}) + "\n")
    lines, problems = gp.moe_figures(machine(H100), tmp_path, "")
    assert problems == [] and "| compiled | 48,171 | 23.6 | 53.6 |" in lines


def test_the_fla_parity_measure_sees_a_one_percent_error():
    from gated_delta_rule import layer_inputs, relative_errors

    from torchtitan.models.shared.gated_delta_rule import gated_delta_rule

    inputs, resets, state = layer_inputs(1, 200, 2, 16, torch.float32, torch.Generator().manual_seed(3))
    resets[0, 70] = True
    same = relative_errors(partial(gated_delta_rule, chunk_size=16), inputs, resets, state, seed=4)
    assert set(same) == {"output", "final state", "dq", "dk", "dv", "dg", "dbeta"}
    assert max(same.values()) < 1e-5, same

    def off_by_one_percent(*args):
        out, final = gated_delta_rule(*args)
        return out * 1.01, final

    off = relative_errors(off_by_one_percent, inputs, resets, state, seed=4)
    assert off["final state"] < 1e-6 and all(off[name] > 3e-3 for name in ("output", "dq", "dk", "dv"))


def test_fla_and_nccl_figures(tmp_path):
    rows = [{"check": "parity", "tensor": "output", "relative_error": 2e-4, "tolerance": 1e-2, "shape": "s"},
            {"check": "parity", "tensor": "dk", "relative_error": 0.03, "tolerance": 1e-2, "shape": "s"},
            {"check": "time", "kernel": "fla", "ms": 3.2, "tokens_per_s": 2.56e6, "shape": "s"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines, problems = gp.fla_figures(machine(H100), tmp_path, "")
    assert "| fla | 3.20 | 2,560,000 |" in lines and problems == ["dk differs by 3.0e-02 (> 0.01)"]
    metrics = [{"step": s, "loss": 8 - s / 4, "tps": 1000.0 + s, "memory_gib": 1.5} for s in range(1, 11)]
    for name in ("run", "qlora"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    lines, problems = gp.nccl_figures(machine(H100, H100), tmp_path, "")
    assert problems == [] and "loss 7.750 -> 5.500, 1,006 tokens/s per GPU" in lines[0]
    assert lines[1].startswith("QLoRA on it (NF4 base sharded), FSDP over 2 GPUs, 10 steps")
    (tmp_path / "qlora" / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": 8.0}) + "\n" for r in metrics))
    assert gp.nccl_figures(machine(H100, H100), tmp_path, "")[1] == ["qlora: the loss did not fall: 8.000 -> 8.000"]
    command = gp.nccl_command(machine(H100, H100), tmp_path)
    assert command[:2] == ["sh", "-c"] and command[2].count("torchtitan.train") == 2 and "lora.base_dtype nf4" in \
        command[2]


@pytest.fixture
def gpu_machine(monkeypatch):
    """main() as on a one-H100 machine, with fake parts; the signal handlers it sets are put back afterwards."""
    import signal

    def probe(python, env, full, timeout):
        return {**machine(H100).info, "packages": PACKAGES} if full else {**machine(H100).info, "packages": {}}

    monkeypatch.setattr(gc, "probe", probe)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield lambda parts: monkeypatch.setattr(gc, "PARTS", parts)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("fails", [True, False])
def test_on_a_gpu_the_report_has_the_environment_every_part_and_the_outcome(tmp_path, gpu_machine, capsys, fails):
    gpu_machine([fake_part("passes", "print('fine')"),
                 fake_part("fails" if fails else "passes too", f"raise SystemExit({int(fails)})")])
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--budget", "20", "--logs", str(tmp_path / "logs")]) == int(fails)
    [report] = out.iterdir()
    assert report.name == f"gpu_check_h100_80gb_hbm3_{time.strftime('%Y-%m-%d', time.gmtime())}.md"
    text = report.read_text()
    outcome = "FAILED: 1 of the 2 parts that ran (fails)" if fails else "passed: all 2 parts that ran"
    assert f"Result: {outcome}." in text and "`scripts/gpu_check.sh --out " in text
    assert "| torch | 2.11.0+cu130 (CUDA 13.0) |" in text and "| torchao | 0.17.0 |" in text
    assert "| GPU | NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.1 GiB, 78.6 GiB free) |" in text
    assert f"| logs | each part's output and files in {tmp_path / 'logs'} |" in text
    assert ("| fla-core | not importable: ModuleNotFoundError" in text) and "| wheels | " in text
    assert (tmp_path / "logs" / "1_passes" / "output.log").read_text() == "fine\n"
    assert "GPU check plan: budget 20 s" in capsys.readouterr().out


def test_plan_on_a_gpu_writes_nothing(tmp_path, gpu_machine, capsys):
    gpu_machine(gc.PARTS)
    assert gc.main(["--plan", "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out").exists()
    printed = capsys.readouterr().out
    assert "  2. dense throughput: benchmarks/gpu_throughput.py compiled and compiled + float8 tensorwise, 8 layers" \
        in printed and "report: " in printed and "gpu_check_h100_80gb_hbm3_" in printed


@pytest.mark.slow
def test_gpu_throughput_writes_the_rows_gpu_check_reads(tmp_path, monkeypatch):
    """benchmarks/gpu_throughput.py --json on a CPU (a one-layer debug model, 3 steps), read as the check reads it."""
    result = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--flavor", "debugmodel", "--layers", "1",
                             "--seq_len", "64", "--steps", "3", "--skip", "1", "--configs", "eager",
                             "--json", str(tmp_path / "rows.jsonl")], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["configuration"], r["layers"], r["seq_len"]) for r in rows] == [("eager", 1, 64)]
    assert rows[0]["tps"] > 0 and rows[0]["loss"] > 0
    monkeypatch.setattr(gp, "dense_configs", lambda m: ["eager"])
    lines, problems = gp.dense_figures(machine(H100), tmp_path, "")
    assert problems == [] and any(line.startswith("| eager | ") for line in lines)


def test_a_second_check_keeps_the_first_report_and_refuses_used_logs(tmp_path, gpu_machine, capsys):
    gpu_machine([fake_part("passes", "print('fine')")])
    out = tmp_path / "out"
    for run in (1, 2):
        assert gc.main(["--out", str(out), "--budget", "20", "--logs", str(tmp_path / f"logs{run}")]) == 0
    day = time.strftime('%Y-%m-%d', time.gmtime())
    assert sorted(p.name for p in out.iterdir()) == [f"gpu_check_h100_80gb_hbm3_{day}-2.md",
                                                       f"gpu_check_h100_80gb_hbm3_{day}.md"]
    before = {p: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as exit_info:  # a used --logs would mix the parts' files with older ones
        gc.main(["--out", str(out), "--budget", "20", "--logs", str(tmp_path / "logs1")])
    assert exit_info.value.code == 2 and f"error: --logs {tmp_path / 'logs1'} holds '1_passes'" in \
        capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.iterdir()} == before
