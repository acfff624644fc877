"""A training objective registered from outside the package (tests/z_loss_objective.py, next-token + z-loss)
trains the debug model through the unchanged trainer and matches its single process under PP 2 and FSDP 2."""

import pytest

from tests.integration.parity import assert_same_steps, rows_of

# 6 steps (the shared matrix trains 4): 2 of warm-up, 4 of decay.
Z_LOSS = ["--experimental.custom_import", "tests.z_loss_objective", "--training.objective", "next_token_z_loss",
          "--training.steps", "6"]
LAYOUTS = {
    "z_loss_single": (1, [*Z_LOSS, "--training.local_batch_size", "8"]),
    "z_loss_pp2": (2, [*Z_LOSS, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "z_loss_fsdp2": (2, [*Z_LOSS, "--training.local_batch_size", "4"]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    return LAYOUTS


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["z_loss_pp2", "z_loss_fsdp2"])
def test_a_registered_objective_matches_its_single_process(debug_runs, layout):
    expected, rows = rows_of(debug_runs, "z_loss_single"), rows_of(debug_runs, layout)
    assert [r["step"] for r in expected] == list(range(1, 7))
    assert_same_steps(rows, expected)
    for ours, ref in zip(rows, expected):
        assert ours["z_loss"] == pytest.approx(ref["z_loss"], rel=1e-4), ours["step"]


@pytest.mark.slow
def test_the_objective_changes_training(debug_runs, reference):
    rows = rows_of(debug_runs, "z_loss_single")
    # Step 1 scores the same initial weights on the same batch: the logged cross-entropy is the plain run's.
    assert rows[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-6)
    # The z-term is in the backward (another gradient from step 1 on); its value is about log(vocab) squared.
    assert abs(rows[0]["grad_norm"] / reference[0]["grad_norm"] - 1) > 1e-3
    assert rows[0]["z_loss"] == pytest.approx(7.6**2, rel=0.2)
