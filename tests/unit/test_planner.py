"""Planner formula pieces against exact counts of the real model and of what its forward saves."""

import pytest
import torch

from scripts import plan as plan_script
from torchtitan import planner
from torchtitan.config import load_config
from torchtitan.distributed.precision import uses_autocast
from torchtitan.inference import build_model
from torchtitan.planner import (
    GIB,
    CpuTiming,
    PlanError,
    cpu_step_seconds,
    layer_activation_bytes,
    model_shape,
    pipeline_ranks,
    plan,
    predict_memory,
    resolve_layout,
)


def config(*overrides):
    # An explicit compute dtype: the formula pieces below take a config that plan() has resolved "auto" in.
    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml",
                          "--training.mixed_precision_param", "bfloat16", *overrides])
    return cfg


def test_parameter_bytes_equal_the_real_model_parameter_count():
    cfg = config("--model.flavor", "tiny", "--training.seq_len", "64")
    model, _ = build_model(cfg)
    real = sum(p.numel() for p in model.parameters())
    m = model_shape(cfg)
    assert m.params == real
    memory = plan(cfg, "CPU", efficiency=0.5).memory  # an efficiency skips the CPU timing calibration
    assert memory.params == real * 4  # fp32 storage
    assert memory.optimizer == 2 * real * 4  # AdamW: two fp32 moments


def test_model_shape_reads_the_widths_of_either_family_from_the_built_model():
    # Qwen3 names its widths differently from Llama and its attention is wider than the model.
    qwen, _ = load_config(["--job.config_file", "train_configs/qwen3_debug.toml", "--model.flavor", "0.6B"])
    m = model_shape(qwen)
    assert (m.dim, m.n_layers, m.n_heads, m.q_dim, m.kv_dim, m.ffn_dim, m.qk_norm) == (
        1024, 28, 16, 2048, 1024, 3072, True)
    assert m.vocab == 151936 and m.output_params == 0  # the output shares the embedding table
    llama = model_shape(config())
    assert (llama.dim, llama.n_heads, llama.q_dim, llama.kv_dim, llama.ffn_dim, llama.qk_norm) == (
        256, 16, 256, 256, 768, False)
    assert llama.output_params == llama.embedding_params


def test_fsdp_divides_parameters_gradients_and_optimizer_state():
    cfg = config("--training.seq_len", "256")
    single = plan(cfg, "H100", world_size=1).memory
    sharded = plan(cfg, "H100", world_size=8).memory
    for field in ("params", "optimizer"):
        assert getattr(sharded, field) == pytest.approx(getattr(single, field) / 8)


def test_tensor_parallel_divides_weights_and_per_layer_activations():
    cfg = config("--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "256")
    m = model_shape(cfg)
    assert predict_memory(m, cfg, resolve_layout(cfg, 2), on_cpu=False).params == pytest.approx(m.params * 4 / 2)
    full, split = (layer_activation_bytes(m, cfg, on_cpu=False, tp=tp) for tp in (1, 2))
    assert split < full


def saved_bytes_per_token(cfg, autocast: bool) -> float:
    """Bytes the first block saves for backward (parameters and their casts excluded), per token."""
    model, _ = build_model(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.dim() > 2 or (t.dim() == 2 and t.shape[0] == 2 * 64):
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    tokens = torch.randint(0, 100, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = model.tok_embeddings(tokens)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.layers["0"](h, model.rope)
    return sum(seen.values()) / tokens.numel()


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
@pytest.mark.parametrize("preset, flavor", [("debug_model", "tiny"), ("qwen3_debug", "debugmodel")])
def test_layer_activation_formula_matches_what_the_forward_saves(preset, flavor, precision):
    # Qwen3 adds QK-norm and has attention wider than the model (8 x 64 heads on dim 256).
    cfg, _ = load_config(["--job.config_file", f"train_configs/{preset}.toml", "--model.flavor", flavor,
                          "--training.seq_len", "64", "--training.mixed_precision_param", precision])
    autocast = uses_autocast(cfg.training)
    assert autocast == (precision == "bfloat16")
    assert layer_activation_bytes(model_shape(cfg), cfg, on_cpu=True, tp=1) == saved_bytes_per_token(cfg, autocast)


def test_activation_checkpointing_lowers_activations():
    modes = [("none", "1"), ("selective", "2"), ("full", "1")]
    totals = [plan(config("--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option",
                          option), "CPU", efficiency=0.5).memory.activations for mode, option in modes]
    assert totals[0] > totals[1] > totals[2]


def test_405b_does_not_fit_on_one_h100():
    cfg, _ = load_config(["--job.config_file", "train_configs/llama3_405b.toml"])
    result = plan(cfg, "H100")
    assert not result.fits and result.memory.total > 1000 * GIB
    assert result.memory.params == model_shape(cfg).params * 4


def test_step_time_scales_with_tokens_and_recomputation():
    base = plan(config("--training.seq_len", "256"), "H100")
    double = plan(config("--training.seq_len", "256", "--training.local_batch_size", "16"), "H100")
    assert double.step_time_s == pytest.approx(2 * base.step_time_s)
    recomputed = plan(config("--training.seq_len", "256", "--activation_checkpoint.mode", "full"), "H100")
    assert 1.2 < recomputed.step_time_s / base.step_time_s < 1.34  # one extra forward of the blocks


def test_unknown_device_and_bad_world_size_are_one_line_errors():
    with pytest.raises(PlanError, match="device 'TPU' is unknown; valid: H100"):
        plan(config(), "TPU")
    with pytest.raises(PlanError, match="world size 3"):
        plan(config("--parallelism.tensor_parallel_degree", "2"), "H100", world_size=3)


def test_cpu_step_time_scales_the_timed_parts_by_layers_recomputation_and_accumulation():
    timing = CpuTiming(block=0.3, rest=0.2, optimizer_per_layer=0.01, optimizer_rest=0.04)
    cfg = config()
    m, layout = model_shape(cfg), resolve_layout(cfg, 1)
    assert m.n_layers == 6
    assert cpu_step_seconds(m, cfg, layout, timing) == pytest.approx(6 * 0.3 + 0.2 + 6 * 0.01 + 0.04)
    full = config("--activation_checkpoint.mode", "full")
    assert cpu_step_seconds(m, full, layout, timing) == pytest.approx(6 * 0.3 * 4 / 3 + 0.2 + 0.1)
    accum = config("--training.global_batch_size", "16")
    assert cpu_step_seconds(m, accum, layout, timing) == pytest.approx(2 * (6 * 0.3 + 0.2) + 0.1)
    # The calibration itself: a block of the real model takes measurable time.
    measured = plan(config("--training.seq_len", "64", "--training.local_batch_size", "1"), "CPU")
    assert measured.step_time_s > 0 and "timed" in measured.speed


def pipeline_config(*overrides):
    return config("--parallelism.pipeline_parallel_degree", "2", "--training.seq_len", "256", *overrides)


def test_pipeline_activations_follow_micro_batches_and_schedule_not_accumulation():
    def activations(*overrides):
        return plan(pipeline_config(*overrides), "H100", world_size=2).memory.activations

    base = activations()
    # Accumulation steps run one after another: a larger global batch does not raise the peak.
    assert activations("--training.global_batch_size", "32") == base
    assert activations("--training.global_batch_size", "64") == base
    # GPipe keeps all 8 micro-batches alive, 1F1B at most one per stage (2).
    assert activations("--parallelism.pipeline_parallel_schedule", "GPipe") > 2 * base
    # Twice the sequences per micro-batch, the same number in flight: twice the activations (fp32, so
    # no autocast weight copies, which do not grow with tokens).
    fp32 = ("--training.mixed_precision_param", "float32")
    assert activations(*fp32, "--parallelism.pipeline_parallel_microbatch_size", "2") == pytest.approx(
        2 * activations(*fp32))


def test_pipeline_ranks_use_the_trainer_stage_split():
    # debugmodel: 6 blocks + embedding + output "layers", split evenly; the ends give up one block each.
    for pp, blocks in (("2", [3, 3]), ("4", [1, 2, 2, 1])):
        cfg = config("--parallelism.pipeline_parallel_degree", pp)
        ranks = pipeline_ranks(model_shape(cfg), cfg, resolve_layout(cfg, int(pp)))
        assert [r.blocks for r in ranks] == blocks
        assert [r.first for r in ranks] == [True] + [False] * (int(pp) - 1)
        assert [r.saved_blocks for r in ranks] == [int(pp) * b for b in blocks]  # 1F1B: min(8, pp) micro-batches


def run_plan(capsys, *argv):
    code = plan_script.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("flags, message", [
    (["--model.flavor", "nope"], "model.flavor = 'nope' is not a flavor"),
    (["--model.name", "nope"], "model.name = 'nope' is unknown"),
    (["--training.seq_len", "0"], "training.seq_len = 0 is invalid"),
    (["--world_size", "3", "--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "3072"],
     "n_heads 16 is not divisible by the tensor-parallel degree 3"),
])
def test_plan_script_rejects_invalid_configs_in_one_line(capsys, flags, message):
    code, out, err = run_plan(capsys, "--config", "train_configs/debug_model.toml", "--device", "H100", *flags)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_plan_script_does_not_time_a_run_that_cannot_fit_the_cpu(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CPU calibration must not run")

    monkeypatch.setattr(planner, "measure_cpu_timing", refuse)
    # 405B cannot fit; the 8B's blocks are over the 200M-parameter limit even when the memory is assumed to fit.
    code, out, _ = run_plan(capsys, "--config", "train_configs/llama3_405b.toml", "--device", "CPU")
    assert code == 3 and "step time: -" in out and "not measured: the run does not fit" in out
    monkeypatch.setattr(planner.speed, "cpu_memory_gib", lambda: 1e6)
    code, out, _ = run_plan(capsys, "--config", "train_configs/llama3_8b.toml", "--device", "CPU")
    assert code == 0 and "not measured: one block has 218M parameters" in out


def test_moe_plan_counts_experts_per_rank_and_all_to_all_volume_by_hand():
    cfg, _ = load_config(["--job.config_file", "train_configs/qwen3_moe_30b_a3b.toml"])
    result = plan(cfg, "H100", world_size=32)
    m = model_shape(cfg)
    assert (m.moe_layers, m.experts, m.top_k, m.expert_dim) == (48, 128, 8, 768)
    assert m.routed_params == 128 * 3 * 2048 * 768
    # 2 x 4096 tokens per rank, 8 copies each of 2048 bf16 values, 7 of 8 to other ranks, out and back; forward,
    # backward and the per-op checkpointing's half recomputation; 48 MoE blocks.
    hand = 2 * 4096 * 8 * 2048 * 2 * 7 / 8 * 2 * 2.5 * 48
    assert planner.all_to_all_bytes(m, result_cfg(cfg), result.layout) == pytest.approx(hand)
    assert f"all-to-all {hand / GIB:.3f} GiB sent per device per step" in result.moe
    assert "16 per EP rank (ep 8, FSDP-sharded 4 ways more)" in result.moe
    # Expert parallelism gathers a block's 16 local experts, not all 128: the FSDP transient shrinks.
    dense_gather = plan(result_cfg(cfg, "--parallelism.expert_parallel_degree", "1"), "H100", world_size=32)
    assert result.memory.transient < dense_gather.memory.transient
    assert planner.gathered_block_params(m, result.layout) == pytest.approx(
        m.block_params - m.routed_params + m.routed_params / 8)
    # The FLOPs are the active parameters': a dense model of the same size would be ~10x more.
    assert m.flops_per_token < 6 * (m.params - m.embedding_params) / 5


def result_cfg(cfg, *overrides):
    again, _ = load_config(["--job.config_file", cfg.job.config_file, "--training.mixed_precision_param", "bfloat16",
                            *overrides])
    return again


def test_a_vision_tower_is_counted_on_the_first_stage_whole_under_tp_and_out_of_the_flops_per_token():
    cfg, _ = load_config(["--job.config_file", "train_configs/vlm_debug.toml", "--training.mixed_precision_param",
                          "float32", "--activation_checkpoint.mode", "none"])
    model, _ = build_model(cfg)
    tower = sum(p.numel() for p in model.visual.parameters())
    m = model_shape(cfg)
    assert m.params == sum(p.numel() for p in model.parameters()) and m.vision_params == tower
    # The decoder's FLOPs: 6 x its parameters without the embeddings, plus attention.
    decoder = m.params - tower - m.embedding_params - m.output_params
    assert m.flops_per_token == pytest.approx(6 * (decoder + m.output_params) + m.attention_flops_per_token)
    single = predict_memory(m, cfg, resolve_layout(cfg, 1), on_cpu=False)
    tp_cfg, _ = load_config(["--job.config_file", "train_configs/vlm_debug.toml", "--training.mixed_precision_param",
                             "float32", "--activation_checkpoint.mode", "none",
                             "--parallelism.tensor_parallel_degree", "2"])
    split = predict_memory(m, tp_cfg, resolve_layout(tp_cfg, 2), on_cpu=False)
    assert split.params == pytest.approx((m.params - tower) * 4 / 2 + tower * 4)  # the tower is replicated
    # Its activations: up to seq_len image tokens a sequence, 4 patches each, through its 2 blocks.
    no_images, _ = load_config(["--job.config_file", "train_configs/vlm_debug.toml", "--training.dataset_format",
                                "text", "--training.dataset", "pydocs", "--training.mixed_precision_param",
                                "float32", "--activation_checkpoint.mode", "none"])
    patches = 8 * 256 * 4
    extra = single.activations - predict_memory(m, no_images, resolve_layout(no_images, 1), on_cpu=False).activations
    assert extra == pytest.approx(4 * patches * 2 * (6 * 128 + 2 * 384))


@pytest.mark.parametrize("family,flavor,billions", [("qwen3_vl", "8B", 8.77), ("qwen3_5", "9B", 9.41),
                                                    ("qwen3_5", "35B-A3B", 35.1)])
def test_the_published_vision_language_flavors_plan(family, flavor, billions):
    cfg, _ = load_config(["--job.config_file", "train_configs/vlm_debug.toml", "--model.name", family,
                          "--model.flavor", flavor, "--training.seq_len", "4096", "--training.local_batch_size", "1",
                          "--training.mixed_precision_param", "bfloat16", "--parallelism.tensor_parallel_degree", "2"])
    result = plan(cfg, "H100", world_size=8)
    m = model_shape(cfg)
    assert m.params / 1e9 == pytest.approx(billions, abs=0.01) and 0.4e9 < m.vision_params < 0.7e9
    assert result.fits and result.memory.params > 0


def test_the_kimi_linear_flavor_plans_with_its_kda_blocks():
    cfg, _ = load_config(["--job.config_file", "train_configs/kimi_linear_debug.toml", "--model.flavor", "48B-A3B",
                          "--training.seq_len", "4096", "--training.local_batch_size", "1",
                          "--parallelism.expert_parallel_degree", "8"])
    result = plan(cfg, "H100", world_size=32)
    m = model_shape(cfg)
    assert m.params / 1e9 == pytest.approx(49.12, abs=0.01) and m.moe_layers == 26
    assert m.mixer_flops_per_token > 0 and result.memory.params > 0
