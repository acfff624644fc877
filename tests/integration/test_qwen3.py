"""Qwen3 end to end: it trains, its checkpoints export to transformers' Qwen3ForCausalLM, and parallel layouts
train the same numbers as a single process."""

import json
import math

import pytest
import torch
import transformers

from tests.conftest import run_module
from tests.generation_checks import SAVE_LAST_STEP, assert_trained_checkpoint_generates_as_the_no_cache_path
from tests.integration.parity import STEPS, Matrix, assert_matches, read_rows, rows_of, runs_under
from torchtitan.inference import load_model

CONFIG = "train_configs/qwen3_debug.toml"
FP32 = ["--training.mixed_precision_param", "float32"]


def test_debug_model_trains(tmp_path):
    result = run_module("torchtitan.train", "--job.config_file", CONFIG, "--training.steps", "10",
                        "--training.seq_len", "128", f"--job.dump_folder={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_rows(tmp_path)]
    assert len(losses) == 10 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    dump = tmp_path_factory.mktemp("qwen3_run")
    result = run_module("torchtitan.train", "--job.config_file", CONFIG, "--training.steps", "3", "--training.seq_len",
                        "128", "--checkpoint.enable", *FP32, f"--job.dump_folder={dump}")
    assert result.returncode == 0, result.stderr[-3000:]
    step, hf = dump / "checkpoint" / "step-3", dump / "hf"
    converted = run_module("scripts.convert_to_hf", str(step), str(hf), "--config", CONFIG)
    assert converted.returncode == 0, converted.stderr[-3000:]
    return step, hf


def test_hf_export_loads_in_transformers_with_our_logits(exported):
    step, hf = exported
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    # The debug model's attention is wider than the model: head_dim must be written, not derived.
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    reference = transformers.Qwen3ForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert reference.config.rope_parameters["rope_theta"] == 1e6
    ours, from_hf_folder = load_model(CONFIG, str(step)), load_model(CONFIG, str(hf))
    tokens = torch.randint(0, config["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert (ours(tokens) - expected).abs().max().item() <= 1e-4
        assert (from_hf_folder(tokens) - expected).abs().max().item() <= 1e-4
    # Trained weights, not the initialisation: step 3 differs from a fresh model.
    fresh = load_model(CONFIG)
    assert not torch.equal(fresh.layers["0"].attention.q_norm.weight, ours.layers["0"].attention.q_norm.weight)


# Parity: fp32, global batch 8, seq 128, parity.STEPS steps; the same numbers as test_distributed.py asks of Llama.
COMMON = [*FP32, "--training.seq_len", "128", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
          "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]
TIED = ["--experimental.custom_import", "tests.integration.tied_qwen3", "--model.name", "qwen3_tied"]
RUNS = {
    # Its last step is saved for the generation engine's check.
    "single": (1, ["--training.local_batch_size", "8", *SAVE_LAST_STEP]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    # TP also checks the QK-norm weights: each rank normalises only its heads, so their gradients must be summed.
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    # Tied embedding/output weights share one FSDP unit.
    "tied_single": (1, [*TIED, "--training.local_batch_size", "8"]),
    "tied_fsdp2": (2, [*TIED, "--training.local_batch_size", "4"]),
    # The last stage keeps a copy of the embedding for its tied output head, on another rank.
    "tied_pp2": (2, [*TIED, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
}


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's parity runs in the suite-wide matrix (integration/conftest.py), names prefixed "qwen3_"."""
    return {"qwen3_": Matrix(RUNS, CONFIG, COMMON)}


@pytest.fixture(scope="module")
def qwen3_runs(suite_runs):
    return runs_under(suite_runs[1], "qwen3_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_layout_matches_single_process(qwen3_runs, layout):
    assert_matches(rows_of(qwen3_runs, layout), rows_of(qwen3_runs, "single"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tied_fsdp2", "tied_pp2"])
def test_tied_embeddings_match_single_process(qwen3_runs, layout):
    assert_matches(rows_of(qwen3_runs, layout), rows_of(qwen3_runs, "tied_single"))


@pytest.mark.slow
def test_the_trained_model_generates_as_the_no_cache_path(debug_folder, qwen3_runs):
    rows = rows_of(qwen3_runs, "single")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert_trained_checkpoint_generates_as_the_no_cache_path(CONFIG, debug_folder / "qwen3_single" / "checkpoint" /
                                                              f"step-{STEPS}")
