"""optimizer.name = "Muon" in parallel layouts: 6 fp32 steps match the single process within 1e-5 (loss and grad
norm) under FSDP 2, TP 2, PP 2, FSDP 2 x TP 2 and HSDP 2 x 2 (debug model) and EP 2, EP 2 x TP 2 (qwen3_moe); under
FSDP 2 and EP 2, each matrix is orthogonalised on exactly one rank per step (muon_count_worker.py counts them).

The Newton-Schulz matmuls run in float32 here, so a layout's sharded sums, not bfloat16 rounding of slightly
different inputs, are all that can differ.
"""

import json

import pytest

from tests.integration.parity import Matrix, assert_same_steps, rows_of

COUNTED = "tests.integration.muon_count_worker:main"

MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--training.steps", "6",
        "--optimizer.lr", "2e-3"]
DEBUG_LAYOUTS = {
    "muon_single": (1, [*MUON, "--training.local_batch_size", "8"], COUNTED),
    "muon_fsdp2": (2, [*MUON, "--training.local_batch_size", "4"], COUNTED),
    "muon_tp2": (2, [*MUON, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "muon_pp2": (2, [*MUON, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "muon_fsdp2_tp2": (4, [*MUON, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "muon_hsdp2x2": (4, [*MUON, "--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree",
                         "2"]),
}
MOE_COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "32", "--metrics.log_freq", "1",
              "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600", *MUON]
EP2 = ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]
MOE_LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"], COUNTED),
    "ep2": (2, EP2, COUNTED),
    "ep2_tp2": (4, [*EP2, "--parallelism.tensor_parallel_degree", "2"]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    return DEBUG_LAYOUTS


def suite_matrices(folder) -> dict[str, Matrix]:
    """The qwen3_moe runs, names prefixed "muon_moe_"."""
    return {"muon_moe_": Matrix(MOE_LAYOUTS, "train_configs/qwen3_moe_debug.toml", MOE_COMMON)}


def assert_within_1e5(rows, reference, learns: bool = True):
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == list(range(1, 7))
    # The debug model learns in 6 steps; qwen3_moe's losses at seq 32 move by batch more than they fall, under
    # AdamW as under Muon, so there the steps only have to differ from the first.
    assert reference[-1]["loss"] < reference[0]["loss"] if learns else len({r["loss"] for r in reference}) == 6
    for ours, ref in zip(rows, reference):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), ours["step"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in DEBUG_LAYOUTS if name != "muon_single"])
def test_muon_matches_the_single_process(debug_runs, layout):
    assert_within_1e5(rows_of(debug_runs, layout), rows_of(debug_runs, "muon_single"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep2_tp2"])
def test_muon_matches_the_single_process_under_expert_parallelism(suite_runs, layout):
    runs = suite_runs[1]
    assert_within_1e5(rows_of(runs, f"muon_moe_{layout}"), rows_of(runs, "muon_moe_single"), learns=False)


def counts(folder, nproc: int) -> list[dict]:
    return [json.loads((folder / f"muon-rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["muon_fsdp2", "muon_moe_ep2"])
def test_each_matrix_is_orthogonalised_on_one_rank_per_step(suite_runs, layout):
    folder, runs = suite_runs
    single = layout.replace("fsdp2", "single").replace("ep2", "single")
    rows_of(runs, layout), rows_of(runs, single)  # both ran
    (reference,) = counts(folder / single, 1)
    ranks = counts(folder / layout, 2)
    assert reference["steps"] == 6 and reference["matrices"] == 6 * len(reference["owned"])
    # The ranks' owned matrices are the single process's, each on exactly one rank, and both ranks have work.
    owned = [name for rank in ranks for name in rank["owned"]]
    assert sorted(owned) == sorted(reference["owned"])
    assert all(rank["owned"] for rank in ranks)
    for rank in ranks:  # and Newton-Schulz ran on exactly those, once per step
        assert rank["steps"] == 6 and rank["matrices"] == 6 * len(rank["owned"])


@pytest.mark.slow
def test_muon_on_eight_processes_across_pipeline_stages_matches_the_single_process(many_process_runs):
    """FSDP 2 x TP 2 x PP 2 (tiny flavor): each stage's ranks exchange their own matrices in the world's
    all-to-alls."""
    rows, reference = rows_of(many_process_runs, "muon_dp2_tp2_pp2"), rows_of(many_process_runs, "muon_single")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # The tiny model's 4 losses move with their batches; that they are Muon's shows against AdamW's.
    adamw = rows_of(many_process_runs, "single")
    assert all(m["loss"] != a["loss"] for m, a in zip(reference[1:], adamw[1:]))
    assert_same_steps(rows, reference)
