"""Parallel layouts on CPU/gloo train the same numbers as a single process (fp32, 6 steps, global batch 8).

DDP and HSDP are covered, with gradient accumulation, by test_gradient_sync.py.
"""


import pytest

from tests.conftest import run_command, run_module
from tests.integration.parity import COMMON, CONFIG, assert_matches, read_rows

LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "fsdp2_accum2": (2, ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "tp2_no_loss_parallel": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                                 "--parallelism.disable_loss_parallel"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_compile": (2, ["--training.local_batch_size", "4", "--compile.enable"]),
    "tp2_compile": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                        "--compile.enable", "--compile.components", "model"]),
    "fsdp2_tp2_compile": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                              "--compile.enable", "--compile.components", "model"]),
    "tp2_compile_loss_without_loss_parallel": (2, ["--training.local_batch_size", "8",
                                                   "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                                                   "--parallelism.disable_loss_parallel"]),
    "fsdp2_selective_op_ac": (2, ["--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "op"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(tmp_path, reference, layout):
    nproc, flags = LAYOUTS[layout]
    result = run_command(["./run_train.sh", *COMMON, *flags, f"--job.dump_folder={tmp_path}"],
                         env={"NGPU": str(nproc), "CONFIG_FILE": CONFIG})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_matches(read_rows(tmp_path), reference)


@pytest.mark.slow
def test_compile_alone_matches_eager(tmp_path, reference):
    result = run_module("torchtitan.train", "--job.config_file", CONFIG, *COMMON, "--training.local_batch_size", "8",
                        "--compile.enable", f"--job.dump_folder={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_matches(read_rows(tmp_path), reference)


VALIDATION = ["--validation.enable", "--validation.freq", "3", "--validation.steps", "2",
              "--validation.seq_len", "256", "--validation.local_batch_size", "8", "--training.local_batch_size", "8"]
VALIDATION_LAYOUTS = {
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2_interleaved": (2, ["--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
}


@pytest.mark.slow
def test_validation_loss_is_the_same_under_tp_pp_and_cp(tmp_path):
    def validation_rows(dump, nproc, flags):
        result = run_command(["./run_train.sh", *COMMON, *VALIDATION, *flags, f"--job.dump_folder={dump}"],
                             env={"NGPU": str(nproc), "CONFIG_FILE": CONFIG})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return [r for r in read_rows(dump) if "val_loss" in r]

    expected = validation_rows(tmp_path / "single", 1, [])
    assert [r["step"] for r in expected] == [3, 6] and expected[1]["val_loss"] < expected[0]["val_loss"]
    for name, (nproc, flags) in VALIDATION_LAYOUTS.items():
        rows = validation_rows(tmp_path / name, nproc, flags)
        assert [r["step"] for r in rows] == [3, 6], name
        for ours, ref in zip(rows, expected):
            assert ours["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4), name
            assert ours["val_tokens"] == ref["val_tokens"], name
