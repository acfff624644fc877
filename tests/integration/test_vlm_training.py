"""The Qwen3-VL debug model on the shapes pictures (train_configs/vlm_debug.toml) in the trainer: every layout trains
the single process's 6 fp32 steps, images and all (the tower replicated under TP, on the first pipeline stage, its
features computed before the context-parallel split), and Qwen3.5's MoE flavor under expert parallelism. The runs (names prefixed "vlm_") are part of the suite-wide
matrix (integration/conftest.py)."""

import pytest

from tests.integration.parity import Matrix, assert_same_steps, rows_of, runs_under

CONFIG = "train_configs/vlm_debug.toml"
MOE = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe"]
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "compile": (1, ["--training.local_batch_size", "8", "--compile.enable"]),
    "ac_full": (1, ["--training.local_batch_size", "8", "--activation_checkpoint.mode", "full"]),
    # Qwen3.5's MoE flavor (the hybrid Gated DeltaNet backbone): its experts split over 2 ranks.
    "moe_single": (1, ["--training.local_batch_size", "8", *MOE]),
    "moe_ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2", *MOE]),
}
COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "112", "--training.steps", "6",
          "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--validation.no_enable",
          "--checkpoint.no_enable", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]


def suite_matrices(folder) -> dict[str, Matrix]:
    """This module's runs in the suite-wide matrix (integration/conftest.py)."""
    return {"vlm_": Matrix(LAYOUTS, CONFIG, COMMON)}


@pytest.fixture(scope="module")
def runs(suite_runs):
    return runs_under(suite_runs[1], "vlm_")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if not n.endswith("single")])
def test_layout_matches_the_single_process(runs, layout):
    reference = rows_of(runs, "moe_single" if layout.startswith("moe_") else "single")
    assert [r["step"] for r in reference] == list(range(1, 7)) and reference[-1]["loss"] < reference[0]["loss"]
    assert_same_steps(rows_of(runs, layout), reference)


def test_the_matrix_rows_show_images_across_the_context_parallel_cuts():
    """The layouts' rows (seq 112; CP 2 cuts them into 4 chunks of 28) hold several pictures, and some picture's
    tokens cross a cut: the features must be placed before the split for those to train alike."""
    from torchtitan.data import build_dataloader, build_tokenizer
    from torchtitan.data.config import Chat
    from torchtitan.models.qwen3_vl.args import qwen3_vl_flavors
    from torchtitan.models.shared.vision_language import image_chat

    chat = Chat(image_min_pixels=4096)
    tokenizer = build_tokenizer("assets/tokenizer_vision")
    loader = build_dataloader(tokenizer, dataset="shapes", dataset_path=None, seq_len=112, local_batch_size=8,
                              dp_rank=0, dp_world_size=1, dataset_format="chat", chat=chat,
                              image_chat=image_chat(qwen3_vl_flavors["debugmodel"], chat))
    batch = next(iter(loader))
    is_image = batch.image_index >= 0
    assert (is_image.sum(1) >= 8).all()  # two pictures or more in every row
    assert any((is_image[:, cut - 1] & is_image[:, cut]).any() for cut in (28, 56, 84))
