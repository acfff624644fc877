"""The Kimi Linear debug model in the trainer (train_configs/kimi_linear_debug.toml): every layout trains the single
process's 6 fp32 steps (Kimi Delta Attention's heads split under TP and its state passed exactly under CP, NoPE MLA,
the MoE's experts split under EP). The runs (names prefixed "kl_") are part of the suite-wide matrix
(integration/conftest.py)."""

import pytest

from tests.integration.parity import Matrix, assert_same_steps, rows_of, runs_under

CONFIG = "train_configs/kimi_linear_debug.toml"
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
    "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    "compile": (1, ["--training.local_batch_size", "8", "--compile.enable"]),
    "ac_full": (1, ["--training.local_batch_size", "8", "--activation_checkpoint.mode", "full"]),
}
COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--training.steps", "6",
          "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py)."""
    return {"kl_": Matrix(LAYOUTS, CONFIG, COMMON)}


@pytest.fixture(scope="module")
def runs(suite_runs):
    return runs_under(suite_runs[1], "kl_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "single"])
def test_layout_matches_the_single_process(runs, layout):
    reference = rows_of(runs, "single")
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert_same_steps(rows_of(runs, layout), reference)
