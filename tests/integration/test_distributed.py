"""Data-parallel layouts on CPU/gloo train the same numbers as a single process (fp32)."""

import json

import pytest

from tests.conftest import run_command, run_module

COMMON = ["--job.config_file", "train_configs/tiny.toml", "--training.mixed_precision_param", "float32",
          "--training.steps", "6", "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600",
          "--comm.train_timeout_seconds", "600"]


def read_rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single process, global batch 8."""
    out = tmp_path_factory.mktemp("single")
    result = run_module("torchtitan.train", *COMMON, "--training.local_batch_size", "8", f"--job.dump_folder={out}")
    assert result.returncode == 0, result.stderr
    return read_rows(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,flags",
    [
        (2, ["--training.local_batch_size", "4"]),  # FSDP 2
        (2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"]),  # DDP 2
        (4, ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"]),  # HSDP 2x2
        (2, ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]),  # FSDP 2 + accumulation
    ],
    ids=["fsdp2", "ddp2", "hsdp2x2", "fsdp2_accum2"],
)
def test_data_parallel_matches_single_process(tmp_path, reference, nproc, flags):
    result = run_command(["./run_train.sh", *COMMON[2:], *flags, f"--job.dump_folder={tmp_path}"],
                         env={"NGPU": str(nproc), "CONFIG_FILE": "train_configs/tiny.toml"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == list(range(1, 7))
    for ours, ref in zip(rows, reference):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ours["step"]
