"""QK-clip (optimizer.qk_clip_threshold) in training: under FSDP 2, TP 2, PP 2 and CP 2 the debug model's Muon steps
with the clip on match the single process (losses and grad norms within 1e-4, the same heads clipped, the same largest
logit), and so do DeepSeek-V3's (MLA) and gpt-oss's (grouped heads with biases and sinks) under TP 2; and in a
longer single-process run whose logits grow past the threshold, the logged largest logit stays within 10% of it
after the first clip, while the same run without the clip (a threshold no logit reaches, so the logits are measured
alike) goes well past it."""

import pytest

from tests.integration.parity import Matrix, assert_same_steps, rows_of

# Muon in float32 at a high lr, so that the attention logits (about 0.7 at initialisation) grow within a few steps.
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--training.steps", "6",
        "--optimizer.lr", "2e-2"]
TAU = 0.5  # below the logits of the first step: every step clips
CLIP = ["--optimizer.qk_clip_threshold", str(TAU)]
# The logit curve: more steps and tokens at a lower lr (Muon's update, relative to the clipped weights, is what the
# logits gain between a step's measurement and the next one's: about 20% a step at lr 1e-2, a few % here; see
# docs/optimizers.md). The unclipped run's largest logit passes the threshold at step 25 and reaches 1.46x it.
CURVE_TAU = 1.25
CURVE = ["--job.config_file", "train_configs/debug_model_muon.toml", "--training.steps", "45", "--training.seq_len",
         "256", "--training.local_batch_size", "4", "--optimizer.muon_ns_dtype", "float32", "--optimizer.lr", "3e-3"]
LAYOUTS = {
    "qkclip_single": (1, [*MUON, *CLIP, "--training.local_batch_size", "8"]),
    "qkclip_fsdp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "4"]),
    "qkclip_tp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    # Deterministic mode fills uninitialised memory with NaN: the placeholder inputs the pipeline's shape inference
    # runs the second stage on, whose logits must not count (they once made a step's maximum NaN, at random).
    "qkclip_pp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "8",
                       "--parallelism.pipeline_parallel_degree", "2", "--debug.deterministic"]),
    # Each rank measures its head and tail query rows against the gathered keys of the whole sequence.
    "qkclip_cp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "8",
                       "--parallelism.context_parallel_degree", "2"]),
    "qkclip_curve_off": (1, [*CURVE, "--optimizer.qk_clip_threshold", "1e9"]),
    "qkclip_curve_on": (1, [*CURVE, "--optimizer.qk_clip_threshold", str(CURVE_TAU)]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    return LAYOUTS


FAMILIES = {"qkclip_mla_": "train_configs/deepseek_v3_debug.toml", "qkclip_sinks_": "train_configs/gpt_oss_debug.toml"}
FAMILY_COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "64", "--metrics.log_freq", "1",
                 "--training.steps", "4", "--training.local_batch_size", "4", "--optimizer.name", "Muon",
                 "--optimizer.muon_ns_dtype", "float32", "--optimizer.lr", "2e-2",
                 "--optimizer.qk_clip_threshold", "0.1",  # the debug flavors' logits start near 0.13
                 "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600"]


def suite_matrices(folder) -> dict[str, Matrix]:
    """DeepSeek-V3 and gpt-oss with the clip, one process and TP 2."""
    layouts = {"single": (1, []), "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"])}
    return {prefix: Matrix(layouts, config, FAMILY_COMMON) for prefix, config in FAMILIES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["qkclip_fsdp2", "qkclip_tp2", "qkclip_pp2", "qkclip_cp2"])
def test_the_clip_matches_the_single_process(debug_runs, layout):
    rows, reference = rows_of(debug_runs, layout), rows_of(debug_runs, "qkclip_single")
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert all(r["qk_clip/heads_clipped"] > 0 for r in reference)  # the clip acts on every step compared
    assert_same_steps(rows, reference)
    for ours, ref in zip(rows, reference):
        assert ours["qk_clip/heads_clipped"] == ref["qk_clip/heads_clipped"], ours["step"]
        assert ours["qk_clip/max_logit"] == pytest.approx(ref["qk_clip/max_logit"], rel=1e-4), ours["step"]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mla_and_grouped_heads_clip_under_tensor_parallelism_as_in_one_process(suite_runs, family):
    runs = suite_runs[1]
    rows, reference = rows_of(runs, f"{family}tp2"), rows_of(runs, f"{family}single")
    assert len(reference) == 4 and all(r["qk_clip/heads_clipped"] > 0 for r in reference)
    assert_same_steps(rows, reference)
    assert [r["qk_clip/heads_clipped"] for r in rows] == [r["qk_clip/heads_clipped"] for r in reference]


@pytest.mark.slow
def test_the_logged_largest_logit_stays_near_the_threshold(debug_runs):
    off_rows, on = rows_of(debug_runs, "qkclip_curve_off"), rows_of(debug_runs, "qkclip_curve_on")
    off = [r["qk_clip/max_logit"] for r in off_rows]
    assert all(r["qk_clip/heads_clipped"] == 0 for r in off_rows)
    assert max(off) > 1.4 * CURVE_TAU  # without the clip the logits go well past the threshold
    first = next(i for i, r in enumerate(on) if r["qk_clip/heads_clipped"] > 0)
    assert len(on) - first > 15
    # The logged maximum is each step's before its clip: the previous step's clipped logits plus one update, measured
    # on a new batch. Every step after the first clip stays within 10% of the threshold.
    after = [(r["step"], r["qk_clip/max_logit"]) for r in on[first + 1:]]
    assert all(logit <= 1.1 * CURVE_TAU for _, logit in after), after
