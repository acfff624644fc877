"""Qwen3-Next debug model in the trainer, on short packed documents (block-causal, several per row, crossing the
context-parallel cuts): every layout trains the single process's steps, a document's logits ignore the one before
it (one process and CP 2), and 200 steps learn. The runs (names prefixed "qn_") are part of the suite-wide matrix
(integration/conftest.py)."""

import json
import math

import pytest
import torch

from tests.generation_checks import SAVE_LAST_STEP
from tests.generation_checks import assert_trained_checkpoint_generates_as_the_no_cache_path as assert_generates
from tests.integration.parity import Matrix, assert_same_steps, rows_of, runs_under
from tests.integration.test_document_masking_training import CHECKS, block_causal_flags, results

CONFIG = "train_configs/qwen3_next_debug.toml"
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "compile": (1, ["--training.local_batch_size", "8", "--compile.enable"]),
    "accum2": (1, ["--training.local_batch_size", "4", "--training.global_batch_size", "8"]),
    "ac_full": (1, ["--training.local_batch_size", "8", "--activation_checkpoint.mode", "full"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
    "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    # 8 chunks of 8 tokens: most rows have a document across each cut.
    "cp4": (4, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "4"]),
    "tp2_cp2": (4, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.context_parallel_degree", "2"]),
    "independence_single": (1, ["--training.local_batch_size", "8"], f"{CHECKS}:independence"),
    "independence_cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"],
                         f"{CHECKS}:independence"),
}
# The last step's model is saved: the generation engine is checked on it.
LONG = ["--training.steps", "200", "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "1", *SAVE_LAST_STEP]


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py)."""
    common = ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--metrics.log_freq", "1",
              "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600",
              *block_causal_flags(folder)]
    return {"qn_": Matrix(LAYOUTS, CONFIG, common), "qn200_": Matrix({"long": (1, [])}, CONFIG, LONG)}


@pytest.fixture(scope="module")
def runs(suite_runs):
    return runs_under(suite_runs[1], "qn_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "single" and not n.startswith("independence")])
def test_layout_matches_the_single_process(runs, layout):
    reference = rows_of(runs, "single")
    assert [r["step"] for r in reference] == list(range(1, 7)) and reference[-1]["loss"] < reference[0]["loss"]
    assert_same_steps(rows_of(runs, layout), reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "cp2"])
def test_a_document_ignores_the_one_before_it(suite_runs, runs, layout):
    rows_of(runs, f"independence_{layout}")
    ranks = results(suite_runs[1], suite_runs[0], f"qn_independence_{layout}")
    with_logits = [r for r in ranks if "changed_a" in r]
    assert with_logits and all("a_embedding_grad" in r for r in ranks)
    for r in with_logits:
        assert r["changed_a"] == 0, r  # exactly: every layer keeps the documents apart, the linear ones too
        assert r["a_logits_moved"] > 1e-3, r
    for r in ranks:
        assert r["a_embedding_grad"] == 0 and r["b_embedding_grad"] > 0, r


@pytest.mark.slow
def test_200_steps_learn(suite_runs):
    rows = rows_of(suite_runs[1], "qn200_long")
    assert len(rows) == 200 and all(math.isfinite(r["loss"]) for r in rows)
    drop = rows[0]["loss"] - sum(r["loss"] for r in rows[-20:]) / 20
    print(f"\nqwen3_next_debug: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} (drop {drop:.3f} nats, mean of "
          "the last 20 steps)")
    assert drop >= 1.0


def test_float8_converts_the_projections_and_trains(tmp_path):
    """float8 (emulated on CPU) on the attention's and the linear layers' projections; the decay and write-strength
    inputs of the linear layers and the router stay in high precision; 2 steps train."""
    from torchtitan.config import load_config
    from torchtitan.config_check import validate_config
    from torchtitan.train import Trainer

    cfg, sources = load_config(["--job.config_file", CONFIG, f"--job.dump_folder={tmp_path}", "--training.steps", "2",
                                "--training.seq_len", "64", "--model.converters", "float8",
                                "--quantize.linear.float8.emulate"])
    validate_config(cfg, sources, world_size=1)
    trainer = Trainer(cfg)
    model = trainer.model_parts[0]
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    for name in ("layers.0.attention.in_proj_qkv", "layers.0.attention.in_proj_z", "layers.0.attention.wo",
                 "layers.3.attention.wq", "layers.3.attention.wo"):
        assert kinds[name] == "Float8Linear", name
    for name in ("layers.0.attention.in_proj_a", "layers.0.attention.in_proj_b", "layers.0.moe.router.gate"):
        assert kinds[name] == "Linear", name
    before = model.layers["0"].attention.in_proj_qkv.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, model.layers["0"].attention.in_proj_qkv.weight)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_the_matrix_data_has_documents_across_every_cp4_cut(tmp_path):
    """The layouts' rows (seq 64, CP 4: 8 chunks of 8) hold several documents, and each cut has one across it."""
    from tests.integration.test_document_masking_training import short_documents
    from torchtitan.data import build_dataloader, build_tokenizer

    loader = build_dataloader(build_tokenizer("assets/tokenizer"), dataset="", dataset_path=str(short_documents(
        tmp_path)), seq_len=64, local_batch_size=8, dp_rank=0, dp_world_size=1)
    ids = next(iter(loader)).document_ids
    assert (ids[:, -1] >= 2).all()
    for cut in range(8, 64, 8):
        assert (ids[:, cut - 1] == ids[:, cut]).any(), cut


@pytest.mark.slow
def test_the_trained_model_generates_as_the_no_cache_path(suite_runs):
    assert len(rows_of(suite_runs[1], "qn200_long")) == 200
    assert_generates(CONFIG, suite_runs[0] / "qn200_long" / "checkpoint" / "step-200")
