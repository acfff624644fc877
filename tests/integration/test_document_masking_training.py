"""Block-causal attention with per-document positions in every layout: the trainer's losses match a single
process, and packed documents stay independent (logits and gradients) under CP, TP, PP and compile."""

import json
import random

import pytest
import torch

from tests.integration.parity import assert_same_steps, rows_of
from torchtitan.data import build_dataloader, build_tokenizer

WORDS = ("alpha beta gamma delta sum list dict tuple return yield import class def lambda error value index "
         "module string bytes float int file path open close read write sort key map filter").split()
STEPS = 6
CHECKS = "tests.integration.document_checks"


def short_documents(folder):
    """A JSONL file of 400 documents of 1..12 words: several per 32-token row, many crossing CP chunks."""
    path = folder / "short_documents.jsonl"
    if not path.exists():
        rng = random.Random(0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))}) + "\n"
                                for _ in range(400)))
    return path


def block_causal_flags(folder):
    return ["--model.attention_mask", "block_causal", "--model.positions", "per_document",
            "--training.dataset_path", str(short_documents(folder)), "--training.steps", str(STEPS)]


LAYOUTS = {
    "bc_reference": (1, []),
    "bc_fsdp2": (2, ["--training.local_batch_size", "4"]),
    "bc_tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "bc_pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "bc_cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "bc_compile": (1, ["--compile.enable"]),
    "independence_single": (1, [], f"{CHECKS}:independence"),
    "independence_compile": (1, ["--compile.enable"], f"{CHECKS}:independence"),
    "independence_cp2": (2, ["--parallelism.context_parallel_degree", "2"], f"{CHECKS}:independence"),
    "independence_tp2": (2, ["--parallelism.tensor_parallel_degree", "2"], f"{CHECKS}:independence"),
    "independence_pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"], f"{CHECKS}:independence"),
    "normalisation_single": (1, ["--training.max_norm", "0"], f"{CHECKS}:loss_normalisation"),
    "normalisation_dp2": (2, ["--training.max_norm", "0", "--training.local_batch_size", "4"],
                          f"{CHECKS}:loss_normalisation"),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    flags = ["--training.local_batch_size", "8", *block_causal_flags(folder)]
    return {name: (nproc, [*flags, *layout]) + tuple(entry) for name, (nproc, layout, *entry) in LAYOUTS.items()}


def results(debug_runs, debug_folder, layout):
    """What each rank of a document_checks layout wrote."""
    rows_of(debug_runs, layout)  # fails with the run's output if it did not finish
    return [torch.load(f) for f in sorted((debug_folder / layout).glob("result-rank*.pt"))]


def test_rows_hold_several_documents_and_some_cross_the_cp_chunk_boundaries(tmp_path):
    tokenizer = build_tokenizer("assets/tokenizer")
    loader = build_dataloader(tokenizer, dataset="", dataset_path=str(short_documents(tmp_path)), seq_len=32,
                              local_batch_size=8, dp_rank=0, dp_world_size=1)
    batch = next(iter(loader))
    ids = batch.document_ids
    assert (ids[:, -1] >= 2).all()  # at least three documents in every row
    # cp 2 cuts a row into 4 chunks of 8: a document on both sides of a cut spans two chunks (or ranks).
    assert any((ids[:, cut - 1] == ids[:, cut]).any() for cut in (8, 16, 24))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bc_fsdp2", "bc_tp2", "bc_pp2", "bc_cp2", "bc_compile"])
def test_block_causal_layouts_match_single_process(debug_runs, layout):
    reference = rows_of(debug_runs, "bc_reference")
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert_same_steps(rows_of(debug_runs, layout), reference)


@pytest.mark.slow
def test_block_causal_changes_the_losses(debug_runs, reference):
    """The block-causal runs are not the causal ones under another name."""
    block_causal = rows_of(debug_runs, "bc_reference")
    assert block_causal[0]["loss"] != pytest.approx(reference[0]["loss"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "compile", "cp2", "tp2", "pp2"])
def test_packed_documents_are_independent(debug_runs, debug_folder, layout):
    ranks = results(debug_runs, debug_folder, f"independence_{layout}")
    with_logits = [r for r in ranks if "changed_a" in r]
    with_grads = [r for r in ranks if "a_embedding_grad" in r]
    assert with_logits and with_grads
    for r in with_logits:
        assert r["changed_a"] <= 1e-6, r
        # B alone sits elsewhere in the row, so under CP its keys are merged in another order: float32 rounding
        # (1.2e-6 on logits up to ~5 here), hence relative to the logits' size.
        assert r["vs_alone"] <= 1e-6 * max(1.0, r["largest_logit"]), r
        assert r["a_logits_moved"] > 1e-3, r  # A's own logits did change
    for r in with_grads:
        assert r["a_embedding_grad"] == 0 and r["b_embedding_grad"] > 0, r


@pytest.mark.slow
def test_loss_is_normalised_by_the_trained_tokens_of_the_whole_step(debug_runs, debug_folder):
    """Two micro-batches with 40 and 4 trained tokens: the same loss and gradients as one micro-batch of
    both (1e-6), and as the two split over two data-parallel ranks."""
    (single,) = results(debug_runs, debug_folder, "normalisation_single")
    dp = results(debug_runs, debug_folder, "normalisation_dp2")[0]
    (loss_two, grads_two), (loss_one, grads_one) = single["two_microbatches"], single["one_microbatch"]
    loss_dp, grads_dp = dp["data_parallel"]
    assert loss_two == pytest.approx(loss_one, abs=1e-6) and loss_dp == pytest.approx(loss_one, abs=1e-6)
    for name, want in grads_one.items():
        assert want.abs().max() > 0, name
        assert (grads_two[name] - want).abs().max() <= 1e-6, name
        assert (grads_dp[name] - want).abs().max() <= 1e-6, name
