"""Context parallelism trains the same numbers as a single process (fp32, 4 steps, global batch 8)."""

import pytest

from tests.integration.parity import (
    assert_matches,
    assert_resumes_under_another_layout,
    assert_tiny_matches_single_process,
    rows_of,
)

CP2 = ["--parallelism.context_parallel_degree", "2"]

LAYOUTS = {
    "cp2_allgather": (2, ["--training.local_batch_size", "8"]),
    "cp2_ring": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_rotate_method", "ring"]),
    "cp2_fsdp2": (4, ["--training.local_batch_size", "4"]),
    "cp2_tp2": (4, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "cp2_compile": (2, ["--training.local_batch_size", "8", "--compile.enable"]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    return {name: (nproc, [*flags, *CP2]) for name, (nproc, flags) in LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_layouts_match_single_process(debug_runs, reference, layout):
    assert_matches(rows_of(debug_runs, layout), reference)


@pytest.mark.slow
def test_cp2_tp2_pp2_on_eight_processes_matches_single_process(many_process_runs):
    assert_tiny_matches_single_process(many_process_runs, "cp2_tp2_pp2")


@pytest.mark.slow
def test_fsdp2_cp2_tp2_pp2_on_sixteen_processes_matches_single_process(many_process_runs):
    """All four dimensions in one mesh."""
    assert_tiny_matches_single_process(many_process_runs, "fsdp2_cp2_tp2_pp2")


@pytest.mark.slow
def test_checkpoint_saved_under_cp2_resumes_under_cp1(tmp_path):
    assert_resumes_under_another_layout(tmp_path, (2, CP2), (1, []))
