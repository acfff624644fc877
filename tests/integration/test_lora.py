"""LoRA: the adapted model starts as its base and trains only its adapters; 6 fp32 steps match the single
process within 1e-4 under FSDP 2, TP 2, FSDP 2 x TP 2, PP 2, compile and CP 2 with activation checkpointing
and the chunked loss (debug model, attention and feed-forward targets: column- and row-parallel bases) and EP 2
(qwen3_moe, attention targets), and QLoRA's under FSDP 2 and FSDP 4, its NF4 base sharded (bytes per rank as the
planner counts) and loaded whole from a DCP checkpoint or a Hugging Face folder; checkpoints hold the adapters and resume exactly on their own base only; bad targets and
settings are refused in one line."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint

from tests.integration.parity import COMMON, Matrix, assert_same_steps, rows_of
from tests.integration.test_training import make_trainer
from torchtitan.components.checkpointing.checkpoint import CheckpointError
from torchtitan.config import ConfigError, load_config
from torchtitan.config_check import validate_config
from torchtitan.models.shared.lora import is_adapted, is_adapter_param
from torchtitan.models.shared.nf4 import is_nf4

LORA = ("--model.converters", "lora", "--lora.rank", "4")
# A high learning rate, so that 6 steps move the adapters (B starts at zero) enough to show in the loss.
TRAIN = [*LORA, "--lora.targets", "attention.*,feed_forward.*", "--training.steps", "6", "--optimizer.lr", "1e-2"]
QLORA = [*TRAIN, "--lora.base_dtype", "nf4"]
NF4_BYTES = "tests.integration.nf4_bytes_worker:main"
DEBUG_LAYOUTS = {
    "lora_single": (1, [*TRAIN, "--training.local_batch_size", "8"]),
    "lora_fsdp2": (2, [*TRAIN, "--training.local_batch_size", "4"]),
    "lora_tp2": (2, [*TRAIN, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "lora_fsdp2_tp2": (4, [*TRAIN, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "lora_pp2": (2, [*TRAIN, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]),
    "lora_compile": (1, [*TRAIN, "--training.local_batch_size", "4", "--training.global_batch_size", "8",
                         "--compile.enable"]),
    # Context parallelism with full activation checkpointing and the chunked loss.
    "lora_cp2_ac_chunked": (2, [*TRAIN, "--training.local_batch_size", "8", "--parallelism.context_parallel_degree",
                                "2", "--activation_checkpoint.mode", "full", "--training.loss_chunk_size", "16"]),
    # QLoRA: the NF4 base is quantised from each whole weight, then FSDP shards the NF4 tensor: every layout computes
    # with the single process's exact base. Its bytes per rank are recorded (nf4_bytes_worker.py).
    "qlora_single": (1, [*QLORA, "--training.local_batch_size", "8"], NF4_BYTES),
    "qlora_fsdp2": (2, [*QLORA, "--training.local_batch_size", "4"], NF4_BYTES),
    "qlora_fsdp4": (4, [*QLORA, "--training.local_batch_size", "2"], NF4_BYTES),
    "qlora_hsdp2x2": (4, [*QLORA, "--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree",
                          "2"], NF4_BYTES),
}


def qlora_loaded_layouts(folder) -> dict[str, tuple]:
    """QLoRA on a base loaded whole (never quantised per shard) from a DCP checkpoint and from a Hugging Face folder:
    the base is a 1-step run of the debug model, which writes both. It runs on 2 processes: the matrix's launch of
    one process runs after the launch of two (other modules' single-process jobs resume two-process checkpoints)."""
    base = ["--training.steps", "1", "--training.local_batch_size", "4", "--checkpoint.enable",
            "--checkpoint.last_save_in_hf"]
    dcp = ["--checkpoint.enable", "--checkpoint.initial_load_path", f"{folder / 'qlora_base'}/checkpoint/step-1"]
    hf = ["--checkpoint.enable", "--checkpoint.initial_load_path", f"{folder / 'qlora_base'}/checkpoint/export-step-1",
          "--checkpoint.initial_load_in_hf"]
    return {"qlora_base": (2, base),
            "qlora_dcp_single": (1, [*QLORA, *dcp, "--training.local_batch_size", "8"], NF4_BYTES),
            "qlora_dcp_fsdp4": (4, [*QLORA, *dcp, "--training.local_batch_size", "2"], NF4_BYTES),
            "qlora_hf_fsdp2": (2, [*QLORA, *hf, "--training.local_batch_size", "4"], NF4_BYTES)}
MOE_COMMON = ["--training.mixed_precision_param", "float32", "--training.seq_len", "32", "--metrics.log_freq", "1",
              "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600", *LORA,
              "--training.steps", "6", "--optimizer.lr", "1e-2"]
MOE_LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]),
}


def debug_layouts(folder):
    """This module's runs of the suite-wide debug-model matrix (the debug_runs fixture)."""
    return {**DEBUG_LAYOUTS, **qlora_loaded_layouts(folder)}


def suite_matrices(folder) -> dict[str, Matrix]:
    """The qwen3_moe runs, names prefixed "lora_moe_"."""
    return {"lora_moe_": Matrix(MOE_LAYOUTS, "train_configs/qwen3_moe_debug.toml", MOE_COMMON)}


QLORA_REFERENCES = {"qlora_fsdp2": "qlora_single", "qlora_fsdp4": "qlora_single", "qlora_hsdp2x2": "qlora_single",
                    # The Hugging Face export holds the DCP checkpoint's float32 weights: one reference serves both.
                    "qlora_dcp_fsdp4": "qlora_dcp_single", "qlora_hf_fsdp2": "qlora_dcp_single"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in DEBUG_LAYOUTS if not name.startswith("qlora")
                                    and not name.endswith("single")] + list(QLORA_REFERENCES) + ["lora_moe_ep2"])
def test_lora_matches_the_single_process(suite_runs, layout):
    runs = suite_runs[1]
    reference = rows_of(runs, QLORA_REFERENCES.get(layout) or ("lora_moe_single" if "moe" in layout else
                                                               "lora_single"))
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert len({r["loss"] for r in reference}) == 6  # the adapters train, so the steps differ
    assert_same_steps(rows_of(runs, layout), reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["qlora_fsdp2", "qlora_fsdp4", "qlora_hsdp2x2", "qlora_dcp_fsdp4", "qlora_hf_fsdp2"])
def test_fsdp_shards_the_nf4_base_as_the_planner_counts_and_holds_the_single_process_slices(suite_runs, layout):
    """Under FSDP the NF4 base is sharded: each rank holds 0.52 bytes per quantised weight / the FSDP degree, and all
    its parameters take the bytes the planner's memory model predicts (models/shared/nf4.nf4_shardable decides for
    both); each shard's dequantised values are bitwise the single process's rows (the base quantised whole, whether
    seeded or loaded from a DCP checkpoint or a Hugging Face folder, never per shard)."""
    from torchtitan.config import load_config
    from torchtitan.planner import NF4_BYTES as PER_WEIGHT
    from torchtitan.planner import model_shape, plan

    folder, _ = suite_runs
    nproc, flags = {**DEBUG_LAYOUTS, **qlora_loaded_layouts(folder)}[layout][:2]
    records = [json.loads((folder / layout / f"nf4-rank{rank}.json").read_text()) for rank in range(nproc)]
    single = json.loads((folder / QLORA_REFERENCES[layout] / "nf4-rank0.json").read_text())
    cfg, _ = load_config(["--job.config_file", "train_configs/debug_model.toml", *COMMON, *flags])
    shape = model_shape(cfg)
    shard = nproc // cfg.parallelism.data_parallel_replicate_degree  # HSDP: sharded over the last mesh dimension
    predicted = shape.nf4_bytes(shard)
    assert len(shape.nf4_shapes) == 7 * 6 and all(r["weights"] == r["sharded"] == 42 for r in records)
    assert all(r["bytes"] == predicted for r in records), (records[0]["bytes"], predicted)
    assert predicted == pytest.approx(PER_WEIGHT * shape.nf4_params / shard) and 0.51 < PER_WEIGHT < 0.52
    assert records[0]["param_bytes"] == pytest.approx(plan(cfg, "CPU", world_size=nproc, efficiency=0.5).memory.params)
    for rank, record in enumerate(records):
        for name, slices in record["values"].items():
            assert slices["1"] == [single["values"][name][str(shard)][rank % shard]], (rank, name)
    print(f"{layout}: NF4 base {records[0]['bytes']:,} bytes per rank (planner {predicted:,.0f}); "
          f"{shape.nf4_params:,} quantised weights, {records[0]['bytes'] / shape.nf4_params:.4f} bytes each")


def test_adapted_model_starts_as_its_base_and_trains_only_its_adapters(tmp_path):
    base = make_trainer(tmp_path / "base", "--training.steps", "5")
    lora = make_trainer(tmp_path / "lora", "--training.steps", "5", *LORA, "--lora.targets", "attention.*,feed_forward.w2")
    model = lora.model_parts[0]
    adapted = [name for name, module in model.named_modules() if is_adapted(module)]
    assert len(adapted) == 5 * len(model.layers)  # wq, wk, wv, wo and w2 of every block
    tokens = next(iter(lora.dataloader)).input_ids.to(lora.device)
    with torch.no_grad():
        assert torch.equal(model(tokens), base.model_parts[0](tokens))

    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    lora.train()
    trained = {id(p) for group in lora.optimizer.param_groups for p in group["params"]}
    for name, p in params.items():
        if is_adapter_param(name):
            assert p.requires_grad and id(p) in trained, name
            # A moved from its start; B left zero. Both now differ from where they began.
            assert not torch.equal(p, before[name]), f"adapter {name} did not change"
        else:
            assert not p.requires_grad and p.grad is None and id(p) not in trained, name
            assert torch.equal(p, before[name]), f"base {name} changed"
    assert set(lora.optimizer.state) == {p for name, p in params.items() if is_adapter_param(name)}


@pytest.mark.parametrize("flags, match", [
    (("--lora.targets", "attention.nothing"),
     "'attention.nothing' matches no Linear layer in the model's blocks; they are named attention.wk, "),
    (("--model.name", "qwen3_moe", "--model.flavor", "debugmodel", "--lora.targets", "moe.experts"),
     r"'moe.experts' matches routed experts \(layers.0.moe.experts\), whose stacked weights are not adapted"),
    (("--model.name", "qwen3_moe", "--model.flavor", "debugmodel", "--lora.targets", "moe.*"), "matches the MoE router's gate"),
])
def test_targets_lora_cannot_adapt_are_refused_in_one_line(tmp_path, flags, match):
    with pytest.raises(ConfigError, match=match) as error:
        make_trainer(tmp_path, *LORA, *flags)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags, match", [
    (("--lora.rank", "0"), "lora.rank = 0 is invalid; it must be >= 1"),
    (("--lora.dropout", "1.0"), r"lora.dropout = 1.0 is invalid; it must be in \[0, 1\)"),
    (("--model.converters", "lora,float8"), "lists 'float8' after 'lora'; list it first"),
    (("--model.converters", "float8", "--lora.targets", "feed_forward.*"),
     "does not list 'lora', but lora.rank, lora.targets is set; add 'lora' to model.converters"),
    (("--lora.base_dtype", "nf4", "--parallelism.tensor_parallel_degree", "2"),
     "parallelism.tensor_parallel_degree = 2 must be 1 with lora.base_dtype = 'nf4'"),
    (("--lora.base_dtype", "nf4", "--lora.train_base"), "cannot train an NF4 base"),
    (("--lora.base_dtype", "nf4", "--training.enable_cpu_offload"), "cannot offload an NF4 base"),
])
def test_bad_lora_settings_are_refused_by_the_config_check(flags, match):
    cfg, sources = load_config(["--job.config_file", "train_configs/tiny.toml", *LORA, *flags])
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, sources, world_size=2)


def _final_params(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model_parts[0].named_parameters()}


def test_lora_checkpoints_hold_the_adapters_and_resume_exactly_on_their_base_only(tmp_path):
    """The base is a plain run's checkpoint; the LoRA run's checkpoints hold its adapters (and their optimizer
    state) but no base weight, resume bitwise, and refuse another base in one line."""
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "3")
    for seed in (0, 1):
        base = make_trainer(tmp_path / f"base{seed}", "--training.steps", "1", "--debug.seed", str(seed), *ckpt)
        base.train()
        base.close()
    lora = (*LORA, *ckpt, "--checkpoint.initial_load_path", str(tmp_path / "base0/checkpoint/step-1"),
            "--training.steps", "6")
    straight = make_trainer(tmp_path / "straight", *lora)
    straight.train()
    straight.close()

    # The uninterrupted run's step-3 checkpoint, in a folder of its own.
    (tmp_path / "resumed/checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight/checkpoint/step-3", tmp_path / "resumed/checkpoint/step-3")
    metadata = torch.distributed.checkpoint.FileSystemReader(tmp_path / "resumed/checkpoint/step-3").read_metadata()
    models = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert models and all(".lora_a." in k or ".lora_b." in k for k in models)
    assert any(k.startswith("optimizer.state.") for k in metadata.state_dict_metadata)
    resumed = make_trainer(tmp_path / "resumed", *lora)
    assert resumed.step == 3
    resumed.train()
    ours, expected = _final_params(resumed), _final_params(straight)
    for name in expected:
        assert torch.equal(ours[name], expected[name]), name

    other = [*lora, "--checkpoint.initial_load_path", str(tmp_path / "base1/checkpoint/step-1")]
    with pytest.raises(CheckpointError, match="adapters were trained on another base model: its tok_embeddings"):
        make_trainer(tmp_path / "resumed", *other, "--training.steps", "9")


def _inner_bytes(t: torch.Tensor) -> int:
    """Storage of a tensor subclass's inner tensors (NF4: codes, scales, their scales), or of a plain tensor."""
    if hasattr(t, "__tensor_flatten__"):
        return sum(_inner_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def test_qlora_stores_the_base_in_nf4_and_trains_only_the_adapters(tmp_path):
    """lora.base_dtype = "nf4": every block Linear weight of the debug model is an NF4Tensor of at most 0.6 bytes
    per weight; the model's logits stay near the float32 base's; 2 steps change the adapters only."""
    flags = ("--model.flavor", "debugmodel", *LORA, "--training.steps", "2", "--optimizer.lr", "1e-2",
             "--training.seq_len", "32", "--training.local_batch_size", "2")
    full = make_trainer(tmp_path / "full", *flags)
    qlora = make_trainer(tmp_path / "nf4", *flags, "--lora.base_dtype", "nf4")
    model = qlora.model_parts[0]
    nf4 = {name: p for name, p in model.named_parameters() if is_nf4(p)}
    assert len(nf4) == 7 * len(model.layers)  # q, k, v, o, w1, w2, w3 of every block
    assert sum(_inner_bytes(p) for p in nf4.values()) / sum(p.numel() for p in nf4.values()) <= 0.6

    tokens = next(iter(qlora.dataloader)).input_ids.to(qlora.device)
    with torch.no_grad():
        reference = full.model_parts[0](tokens)
        error = ((model(tokens) - reference).norm() / reference.norm()).item()
    assert 0 < error < 0.05, error  # 4 bits per weight: close to the base, not equal to it
    print(f"NF4 base vs float32 base: relative logits error {error:.4f}")

    before = {name: p.detach().to(torch.float32).clone() for name, p in model.named_parameters()}
    qlora.train()
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach().to(torch.float32), before[name])
        assert changed == is_adapter_param(name), name


def test_lora_on_float8_base_layers_trains_the_adapters_in_high_precision(tmp_path):
    """converters = ["float8", "lora"]: the adapted layers are float8 Linears (emulated on CPU) whose adapters are
    plain Linears; 2 steps train the adapters only."""
    trainer = make_trainer(tmp_path, "--model.converters", "float8,lora", "--quantize.linear.float8.emulate",
                           "--lora.rank", "16", "--training.steps", "2", "--optimizer.lr", "1e-2")
    model = trainer.model_parts[0]
    adapted = [m for m in model.modules() if is_adapted(m)]
    assert adapted and all(type(m).__name__ == "LoRAFloat8Linear" for m in adapted)
    assert all(type(m.lora_a) is torch.nn.Linear and type(m.lora_b) is torch.nn.Linear for m in adapted)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != is_adapter_param(name), name
