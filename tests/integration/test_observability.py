"""What the trainer writes for people watching a run, read back from disk."""

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import torch

from tests.conftest import REPO
from tests.integration.test_training import make_trainer
from torchtitan.components.metrics import peak_flops
from torchtitan.components.metrics.peak_flops import device_peak_tflops, gpu_peak_tflops


def train(tmp_path, *flags):
    trainer = make_trainer(tmp_path, "--training.steps", "6", "--metrics.log_freq", "2", *flags)
    trainer.train()
    trainer.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_file_holds_the_loss_series(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = train(tmp_path, "--metrics.enable_tensorboard")
    events = list((tmp_path / "tb" / "rank0").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 4, 6]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {"grad_norm", "lr", "tps", "mfu", "data_pct"} <= set(acc.Tags()["scalars"])


def _wandb_records(path):
    """Parse a .wandb file: a LevelDB-style log of protobuf Records in 32 KiB blocks after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, payload, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def test_wandb_offline_run_directory_holds_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb (or one of its dependencies) cannot be imported here")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = train(tmp_path, "--metrics.enable_wandb", "--metrics.wandb_project", "titan-tests")
    # run.finish() only informs wandb's service process; the service closes the run's stream (and flushes the
    # .wandb file) asynchronously. A training process gets that wait from wandb's atexit teardown; this test
    # reads the file in the same process, so it waits for the service explicitly.
    import wandb

    wandb.teardown()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = _wandb_records(next(runs[0].glob("run-*.wandb")))
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.append({("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in r.history.item})
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "titan-tests"


def test_a_backend_that_cannot_be_imported_is_a_one_line_error(tmp_path, monkeypatch):
    from torchtitan.components.metrics.backends import MetricsBackendError, WandbBackend

    monkeypatch.setitem(sys.modules, "wandb", None)  # what a missing package (or dependency) looks like
    with pytest.raises(MetricsBackendError) as error:
        WandbBackend(tmp_path, None, None, {}, None)
    assert str(error.value) == ("metrics.enable_wandb needs wandb, which cannot be imported here (ModuleNotFoundError: "
                                "import of wandb halted; None in sys.modules); install it with its dependencies or "
                                "turn metrics.enable_wandb off")


def test_profiler_writes_a_chrome_trace_every_profile_freq_steps(tmp_path):
    train(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "3",
          "--profiling.enable_memory_snapshot")
    traces = sorted((tmp_path / "profile_traces").glob("iteration_*/rank0_trace.json"))
    assert [t.parent.name for t in traces] == ["iteration_3", "iteration_6"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("ProfilerStep#") for n in names)
    assert "aten::mm" in names or "aten::addmm" in names
    device = json.loads((tmp_path / "provenance.json").read_text())["device"]["type"]
    snapshots = sorted(p.parent.name for p in (tmp_path / "memory_snapshot").glob("*/rank0_memory_snapshot.pickle"))
    # CUDA: the allocator's history at each profiled step; CPU: none (skipped with a warning).
    assert snapshots == (["iteration_3", "iteration_6"] if device == "cuda" else [])


def test_time_breakdown_and_provenance(tmp_path):
    rows = train(tmp_path)
    for r in rows:
        assert 0 <= r["data_pct"] <= 100
        assert 0 <= r["data_time_s"] <= r["step_time_s"]
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert provenance["git_commit"] == head
    assert provenance["packages"]["torch"] == torch.__version__
    assert provenance["layout"]["world_size"] == 1
    assert provenance["device"]["type"] == "cpu"


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise(tmp_path):
    args = [sys.executable, "-m", "torchtitan.train", "--job.config_file", "train_configs/tiny.toml",
            "--training.steps", "5", f"--job.dump_folder={tmp_path}"]
    plain = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    assert plain.returncode == 0 and "\r" not in plain.stdout and "step: 5  loss:" in plain.stdout

    leader, follower = pty.openpty()
    # A new pty is 0 columns wide, which tqdm draws as nothing; give it a real terminal's size.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(args, cwd=REPO, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait() == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", output.decode(errors="replace"))  # drop the terminal colors
    assert re.search(r"5/5 \[\d\d:\d\d<\d\d:\d\d", text)  # tqdm's bar: count, elapsed < ETA
    assert "step: 5  loss:" in text  # log lines still come through


def test_peak_table_override_and_unknown_devices(caplog):
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312.0
    assert gpu_peak_tflops("Some Future Accelerator", "bfloat16") is None
    assert device_peak_tflops(torch.device("cpu"), torch.bfloat16, override=123.0) == 123.0
    assert device_peak_tflops(torch.device("meta"), torch.bfloat16, override=None) is None
    assert "MFU is not reported" in caplog.text


def test_matmul_calibration_measures_real_throughput():
    tflops = peak_flops.measure_matmul_tflops(torch.float32, threads=1, budget_seconds=0.5)
    assert 0.001 < tflops < 100
