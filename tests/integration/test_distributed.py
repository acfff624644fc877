"""Parallel layouts on CPU/gloo train the same numbers as a single process (fp32, 4 steps, global batch 8).

DDP and HSDP are covered, with gradient accumulation, by test_gradient_sync.py.
"""


import pytest

from tests.generation_checks import assert_trained_checkpoint_generates_as_the_no_cache_path
from tests.integration.parity import STEPS, CONFIG, assert_matches, rows_of

LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "fsdp2_accum2": (2, ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "tp2_no_loss_parallel": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                                 "--parallelism.disable_loss_parallel"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    # The compiled layouts keep 4 sequences per rank and step (accumulating where the data-parallel degree is
    # 1), so layouts with the same per-rank shapes reuse each other's compiled kernels from the inductor cache.
    "fsdp2_compile": (2, ["--training.local_batch_size", "4", "--compile.enable"]),
    "tp2_compile": (2, ["--training.local_batch_size", "4", "--training.global_batch_size", "8",
                        "--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.components",
                        "model"]),
    "fsdp2_tp2_compile": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                              "--compile.enable", "--compile.components", "model"]),
    "tp2_compile_loss_without_loss_parallel": (2, ["--training.local_batch_size", "4",
                                                   "--training.global_batch_size", "8",
                                                   "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                                                   "--parallelism.disable_loss_parallel"]),
    "fsdp2_selective_op_ac": (2, ["--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "op"]),
    "compile_alone": (1, ["--training.local_batch_size", "4", "--training.global_batch_size", "8",
                          "--compile.enable"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(debug_runs, reference, layout):
    assert_matches(rows_of(debug_runs, layout), reference)


VALIDATION = ["--training.steps", "6", "--validation.enable", "--validation.freq", "3", "--validation.steps", "2",
              "--validation.seq_len", "32", "--validation.local_batch_size", "8", "--training.local_batch_size", "8"]
VALIDATION_LAYOUTS = {
    "val_single": (1, VALIDATION),
    "val_tp2": (2, [*VALIDATION, "--parallelism.tensor_parallel_degree", "2"]),
    "val_pp2_interleaved": (2, [*VALIDATION, "--parallelism.pipeline_parallel_degree", "2",
                                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "val_cp2": (2, [*VALIDATION, "--parallelism.context_parallel_degree", "2"]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    return {**LAYOUTS, **VALIDATION_LAYOUTS}


@pytest.mark.slow
def test_validation_loss_is_the_same_under_tp_pp_and_cp(debug_runs):
    expected = [r for r in rows_of(debug_runs, "val_single") if "val_loss" in r]
    assert [r["step"] for r in expected] == [3, 6] and expected[1]["val_loss"] < expected[0]["val_loss"]
    for name in VALIDATION_LAYOUTS:
        rows = [r for r in rows_of(debug_runs, name) if "val_loss" in r]
        assert [r["step"] for r in rows] == [3, 6], name
        for ours, ref in zip(rows, expected):
            assert ours["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4), name
            assert ours["val_tokens"] == ref["val_tokens"], name


@pytest.mark.slow
def test_the_trained_reference_generates_as_the_no_cache_path(debug_folder, reference):
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert_trained_checkpoint_generates_as_the_no_cache_path(CONFIG, debug_folder / "reference" / "checkpoint" /
                                                              f"step-{STEPS}")
