"""Context parallelism trains the same numbers as a single process (fp32, 6 steps, global batch 8)."""

import os

import pytest

from tests.conftest import run_command, run_module
from tests.integration.test_distributed import COMMON, CONFIG, assert_matches, read_rows, reference  # noqa: F401
from tests.integration.test_pipeline import train

CP2 = ["--parallelism.context_parallel_degree", "2"]

LAYOUTS = {
    "cp2_allgather": (2, ["--training.local_batch_size", "8"]),
    "cp2_ring": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_rotate_method", "ring"]),
    "cp2_fsdp2": (4, ["--training.local_batch_size", "4"]),
    "cp2_tp2": (4, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "cp2_compile": (2, ["--training.local_batch_size", "8", "--compile.enable"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_layouts_match_single_process(tmp_path, reference, layout):  # noqa: F811
    nproc, flags = LAYOUTS[layout]
    assert_matches(train(tmp_path, nproc, [*flags, *CP2]), reference)


@pytest.mark.slow
def test_cp2_tp2_pp2_on_eight_processes_matches_single_process(tmp_path):
    common = ["--training.mixed_precision_param", "float32", "--training.steps", "4", "--metrics.log_freq", "1",
              "--training.local_batch_size", "8",
              "--comm.init_timeout_seconds", "900", "--comm.train_timeout_seconds", "900"]
    config = "train_configs/tiny.toml"
    single = tmp_path / "single"
    result = run_module("torchtitan.train", "--job.config_file", config, *common, f"--job.dump_folder={single}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train(tmp_path / "4d", 8, [*CP2, "--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.pipeline_parallel_degree", "2"], config=config, common=common)
    expected = read_rows(single)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for ours, ref in zip(rows, expected):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_checkpoint_saved_under_cp2_resumes_under_cp1(tmp_path):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--training.local_batch_size", "8"]
    straight = train(tmp_path / "straight", 2, [*ckpt, *CP2])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    os.system(f"cp -r {tmp_path}/straight/checkpoint/step-3 {resumed}/checkpoint/")
    result = run_command(["./run_train.sh", *COMMON, *ckpt, f"--job.dump_folder={resumed}"],
                         env={"NGPU": "1", "CONFIG_FILE": CONFIG})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from step 3" in result.stdout + result.stderr
    rows = read_rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    for ours, ref in zip(rows, straight[3:]):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ours["step"]
