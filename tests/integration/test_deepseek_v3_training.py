"""DeepSeek-V3 debug model in the trainer: every supported layout trains the single process's steps, and 200
steps learn with the experts kept even by the routing bias. The runs (names prefixed "ds_") are part of the
suite-wide matrix (integration/conftest.py)."""

import math

import pytest

from tests.generation_checks import SAVE_LAST_STEP
from tests.generation_checks import assert_trained_checkpoint_generates_as_the_no_cache_path as assert_generates
from tests.integration.parity import Matrix, assert_same_steps, embedding_copies, rows_of, runs_under

CONFIG = "train_configs/deepseek_v3_debug.toml"
COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--training.steps", "6",
          "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
EMBEDDING_WORKER = "tests.integration.shared_embedding_worker:main"
EP2_PP2 = ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.expert_parallel_degree", "2"]
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "compile": (1, ["--training.local_batch_size", "8", "--compile.enable"]),
    # Every depth's loss through the chunked output head.
    "chunked_loss": (1, ["--training.local_batch_size", "8", "--training.loss_chunk_size", "96"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
    "ep2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2",
                    "--parallelism.tensor_parallel_degree", "2"]),
    "cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    # The last stage runs the MTP block with its own copy of the embedding (kept equal to the first stage's).
    "ep2_pp2": (4, [*EP2_PP2, "--checkpoint.enable", "--checkpoint.interval", "3"], EMBEDDING_WORKER),
    "single_no_mtp": (1, ["--training.local_batch_size", "8", "--model.mtp_depth", "0"]),
    # MLA's TP plan with the low-rank query (wq_a, q_norm computed whole on every rank), against its own reference.
    "single_qlora": (1, ["--training.local_batch_size", "8", "--model.flavor", "debug_qlora"]),
    "qlora_tp2": (2, ["--training.local_batch_size", "8", "--model.flavor", "debug_qlora",
                      "--parallelism.tensor_parallel_degree", "2"]),
}
REFERENCE = {"qlora_tp2": "single_qlora"}


# The last step's model is saved: the generation engine is checked on it.
LONG = ["--training.mixed_precision_param", "float32", "--training.steps", "200", "--lr_scheduler.warmup_steps", "10",
        "--metrics.log_freq", "1", *SAVE_LAST_STEP]


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py)."""
    # Resumed from the EP 2 x PP 2 run's step 3 (model with its MTP block and both embedding copies, optimizer,
    # data position), in the same launch after it.
    resumed = (4, [*EP2_PP2, "--checkpoint.enable", "--checkpoint.initial_load_path",
                   str(folder / "ds_ep2_pp2" / "checkpoint" / "step-3"), "--checkpoint.no_initial_load_model_only"])
    return {"ds_": Matrix({**LAYOUTS, "ep2_pp2_resumed": resumed}, CONFIG, COMMON),
            "ds200_": Matrix({"long": (1, [])}, CONFIG, LONG)}


@pytest.fixture(scope="module")
def runs(suite_runs):
    """This module's runs, by its own layout names."""
    return runs_under(suite_runs[1], "ds_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if not name.startswith("single")])
def test_layout_matches_the_single_process(runs, layout):
    reference = rows_of(runs, REFERENCE.get(layout, "single"))
    assert [r["step"] for r in reference] == list(range(1, 7)) and reference[-1]["loss"] < reference[0]["loss"]
    rows = rows_of(runs, layout)
    assert_same_steps(rows, reference)
    # The multi-token prediction loss, reported beside the main one, too.
    assert [r["mtp/loss"] for r in rows] == pytest.approx([r["mtp/loss"] for r in reference], rel=1e-4)


@pytest.mark.slow
def test_a_pipeline_run_with_mtp_resumes_exactly(runs):
    rows, reference = rows_of(runs, "ep2_pp2_resumed"), rows_of(runs, "single")
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert_same_steps(rows, reference[3:])
    assert [r["mtp/loss"] for r in rows] == pytest.approx([r["mtp/loss"] for r in reference[3:]], rel=1e-4)


@pytest.mark.slow
def test_the_pipelines_two_embedding_copies_stay_identical(suite_runs, runs):
    rows_of(runs, "ep2_pp2")
    steps = embedding_copies(suite_runs[0] / "ds_ep2_pp2", nproc=4)
    assert len(steps) == 6
    for copies in steps:
        # Two pipelines (the FSDP/EP pairs), each with a first- and a last-stage copy: four, all one tensor.
        assert sorted(c["first"] for c in copies) == [False, False, True, True]
        assert len({c["sha"] for c in copies}) == 1
    assert steps[0][0]["sha"] != steps[-1][0]["sha"]  # and they trained


@pytest.mark.slow
def test_multi_token_prediction_trains_and_is_reported_apart(runs):
    with_mtp, without = rows_of(runs, "single"), rows_of(runs, "single_no_mtp")
    # The same weights and data: the next-token loss of the first step is the same number with or without MTP
    # (its blocks only add a loss), and from then on the extra gradient makes the runs differ.
    assert with_mtp[0]["loss"] == pytest.approx(without[0]["loss"], rel=1e-6)
    assert with_mtp[0]["grad_norm"] != pytest.approx(without[0]["grad_norm"], rel=1e-3)
    assert "mtp/loss" not in without[0]
    assert all(math.isfinite(r["mtp/loss"]) for r in with_mtp) and with_mtp[-1]["mtp/loss"] < with_mtp[0]["mtp/loss"]


@pytest.mark.slow
def test_200_steps_learn_with_even_experts(suite_runs):
    rows = rows_of(suite_runs[1], "ds200_long")
    assert len(rows) == 200 and all(math.isfinite(r["loss"]) for r in rows)
    last = rows[-20:]
    drop = rows[0]["loss"] - sum(r["loss"] for r in last) / 20
    balance = sum(r["moe/max_over_mean"] for r in last) / 20
    # With multi-token prediction on, "loss" is the next-token loss alone; the MTP loss is its own metric.
    mtp_drop = rows[0]["mtp/loss"] - sum(r["mtp/loss"] for r in last) / 20
    print(f"\nnext-token loss drop {drop:.3f} nats, MTP loss drop {mtp_drop:.3f} nats, busiest/mean expert load "
          f"over the last 20 steps {balance:.3f}")
    assert drop >= 1.0 and balance <= 1.5 and mtp_drop > 0.5


@pytest.mark.slow
def test_the_trained_model_generates_as_the_no_cache_path(suite_runs):
    assert len(rows_of(suite_runs[1], "ds200_long")) == 200
    assert_generates(CONFIG, suite_runs[0] / "ds200_long" / "checkpoint" / "step-200")
