"""gpt-oss debug model in the trainer, on short packed documents (block-causal; 16-token windows crossing the
context-parallel cut): every layout trains the single process's steps, and 200 steps learn. The runs (names
prefixed "go_") are part of the suite-wide matrix (integration/conftest.py)."""

import math

import pytest

from tests.generation_checks import SAVE_LAST_STEP
from tests.generation_checks import assert_trained_checkpoint_generates_as_the_no_cache_path as assert_generates
from tests.integration.parity import Matrix, assert_same_steps, rows_of, runs_under
from tests.integration.test_document_masking_training import block_causal_flags

CONFIG = "train_configs/gpt_oss_debug.toml"
EP2 = ["--parallelism.expert_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "compile": (1, ["--training.local_batch_size", "8", "--compile.enable"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", *TP2]),
    "ep2": (2, ["--training.local_batch_size", "4", *EP2]),
    "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    "ep2_tp2": (4, ["--training.local_batch_size", "4", *EP2, *TP2]),
}
# The last step's model is saved: the generation engine is checked on it.
LONG = ["--training.steps", "200", "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "1", *SAVE_LAST_STEP]


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py)."""
    common = ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--metrics.log_freq", "1",
              "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600",
              *block_causal_flags(folder)]
    return {"go_": Matrix(LAYOUTS, CONFIG, common), "go200_": Matrix({"long": (1, [])}, CONFIG, LONG)}


@pytest.fixture(scope="module")
def runs(suite_runs):
    return runs_under(suite_runs[1], "go_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "single"])
def test_layout_matches_the_single_process(runs, layout):
    reference = rows_of(runs, "single")
    assert [r["step"] for r in reference] == list(range(1, 7)) and reference[-1]["loss"] < reference[0]["loss"]
    assert_same_steps(rows_of(runs, layout), reference)


@pytest.mark.slow
def test_200_steps_learn(suite_runs):
    rows = rows_of(suite_runs[1], "go200_long")
    assert len(rows) == 200 and all(math.isfinite(r["loss"]) for r in rows)
    drop = rows[0]["loss"] - sum(r["loss"] for r in rows[-20:]) / 20
    print(f"\ngpt_oss_debug: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} (drop {drop:.3f} nats, mean of "
          "the last 20 steps)")
    assert drop >= 1.0


@pytest.mark.slow
def test_the_trained_model_generates_as_the_no_cache_path(suite_runs):
    assert len(rows_of(suite_runs[1], "go200_long")) == 200
    assert_generates(CONFIG, suite_runs[0] / "go200_long" / "checkpoint" / "step-200")
