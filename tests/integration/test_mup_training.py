"""µP through the trainer: at the base width it is the standard run bit for bit; at another width it trains and
matches its single process under FSDP 2 x TP 2 (the lr multipliers reach DTensor parameters), and the logged lr is
optimizer.lr's schedule, not a multiplied group's."""

import pytest

from tests.integration.parity import COMMON, assert_same_steps, rows_of
from tests.integration.test_muon_training import MUON

# The debug model is 256 wide with 16 heads of 16: base width 64 with 16 heads of 4, at 10x the preset's lr (the
# hidden matrices take a quarter of it).
MUP = ["--model.mup.base_width", "64", "--model.mup.base_head_dim", "4", "--optimizer.lr", "0.008"]
LAYOUTS = {
    "mup_base_width": (1, ["--training.local_batch_size", "8", "--model.mup.base_width", "256"]),
    "mup_muon_standard": (1, [*MUON, "--training.local_batch_size", "8"]),
    "mup_base_width_muon": (1, [*MUON, "--training.local_batch_size", "8", "--model.mup.base_width", "256"]),
    "mup_single": (1, ["--training.local_batch_size", "8", *MUP, "--checkpoint.enable", "--checkpoint.interval", "2"]),
    "mup_fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2", *MUP]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture); mup_resumed continues
    mup_single from its step-2 checkpoint (the optimizer's groups split by multiplier)."""
    resumed = (1, ["--training.local_batch_size", "8", *MUP, "--checkpoint.enable", "--checkpoint.initial_load_path",
                   str(folder / "mup_single" / "checkpoint" / "step-2"), "--checkpoint.no_initial_load_model_only"])
    return {**LAYOUTS, "mup_resumed": resumed}


@pytest.mark.slow
@pytest.mark.parametrize("layout,standard", [("mup_base_width", "reference"),
                                             ("mup_base_width_muon", "mup_muon_standard")])
def test_at_the_base_width_mup_trains_exactly_the_standard_run(debug_runs, reference, layout, standard):
    rows, expected = rows_of(debug_runs, layout), rows_of(debug_runs, standard)
    assert len(rows) == len(expected) >= 4
    for ours, ref in zip(rows, expected):
        assert (ours["loss"], ours["grad_norm"], ours["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"])


@pytest.mark.slow
def test_mup_at_a_quarter_of_the_base_width_trains_and_matches_under_fsdp_and_tp(debug_runs, reference):
    single = rows_of(debug_runs, "mup_single")
    assert_same_steps(rows_of(debug_runs, "mup_fsdp2_tp2"), single)
    assert single[-1]["loss"] < single[0]["loss"]
    # Another model than the standard one (init, logits, attention), with the same logged lr schedule.
    assert abs(single[0]["loss"] - reference[0]["loss"]) > 1e-3
    assert [r["lr"] for r in single] == pytest.approx([10 * r["lr"] for r in reference])
    assert "--optimizer.lr" not in COMMON  # the reference's lr is the preset's, 8e-4


@pytest.mark.slow
def test_a_mup_run_resumes_exactly(debug_runs):
    rows, straight = rows_of(debug_runs, "mup_resumed"), rows_of(debug_runs, "mup_single")
    assert [r["step"] for r in rows] == [3, 4]
    for ours, ref in zip(rows, straight[2:]):
        assert (ours["loss"], ours["grad_norm"], ours["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"])
