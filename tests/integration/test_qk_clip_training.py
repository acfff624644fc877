"""QK-clip (optimizer.qk_clip_threshold) in training: under FSDP 2, TP 2, PP 2 and CP 2 the debug model's Muon steps
with the clip on match the single process (losses and grad norms within 1e-4, the same heads clipped, the same largest
logit), and so do DeepSeek-V3's (MLA) and gpt-oss's (grouped heads with biases and sinks) under TP 2; and in a
longer single-process run whose logits grow past the threshold, the logged largest logit stays within 10% of it
after the first clip (but for a step where a head the clip had not touched yet jumps past it), while the same run
without the clip (a threshold no logit reaches, so the logits are measured alike) goes well past it."""

import pytest

from tests.integration.parity import Matrix, assert_same_steps, rows_of

# Muon in float32 at a high lr, so that the attention logits (about 0.7 at initialisation) grow within a few steps.
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--training.steps", "6",
        "--optimizer.lr", "2e-2"]
TAU = 0.5  # below the logits of the first step: every step clips
CLIP = ["--optimizer.qk_clip_threshold", str(TAU)]
# The logit curve: more steps and tokens, a lower lr; the unclipped run's largest logit passes the threshold near
# step 12, where it grows a few % a step (one step's update on top of the clip), and reaches 1.5x it by step 30.
CURVE_TAU = 1.5
CURVE = ["--job.config_file", "train_configs/debug_model_muon.toml", "--training.steps", "30", "--training.seq_len",
         "256", "--training.local_batch_size", "4", "--optimizer.muon_ns_dtype", "float32", "--optimizer.lr", "1e-2"]
LAYOUTS = {
    "qkclip_single": (1, [*MUON, *CLIP, "--training.local_batch_size", "8"]),
    "qkclip_fsdp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "4"]),
    "qkclip_tp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "qkclip_pp2": (2, [*MUON, *CLIP, "--training.local_batch_size", "8",
                       "--parallelism.pipeline_parallel_degree", "2"]),
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
    # The clip scales by the step's pre-update logits, so the next batch sees them plus one update (a few %). A
    # head still under the threshold cannot be clipped ahead of a batch that lifts it far past it: such a step's
    # maximum is the unclipped run's own (the clip has not touched that head yet). Every other step stays within
    # 10% of the threshold.
    for step, (ours, unclipped) in enumerate(zip(on[first + 1:], off[first + 1:]), start=first + 2):
        logit = ours["qk_clip/max_logit"]
        assert logit <= 1.1 * CURVE_TAU or logit == pytest.approx(unclipped, rel=1e-2), (step, logit, unclipped)
    assert sum(r["qk_clip/max_logit"] <= 1.1 * CURVE_TAU for r in on[first + 1:]) >= len(on) - first - 2
