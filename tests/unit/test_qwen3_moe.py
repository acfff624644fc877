"""Qwen3-MoE: published sizes, the Hugging Face mapping both ways against transformers, and the configuration
rules of MoE and expert parallelism (all in one process)."""

import json
import logging

import pytest
import torch
import transformers

from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.config import ConfigError, load_config
from torchtitan.config.job_config import Parallelism
from torchtitan.config_check import validate_config
from torchtitan.data import build_tokenizer
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.inference import load_model
from torchtitan.models.qwen3_moe import Qwen3MoeStateDictAdapter, qwen3_moe_flavors
from torchtitan.models.shared.decoder import Decoder
from torchtitan.protocols import count_params

CONFIG = "train_configs/qwen3_moe_debug.toml"


# Totals and active parameters per token (embedding included) of the released checkpoints.
@pytest.mark.parametrize("flavor, total, active", [("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)])
def test_published_sizes_have_the_published_total_and_active_parameters(flavor, total, active):
    args = qwen3_moe_flavors[flavor].finalize(tokenizer_vocab_size=2048, seq_len=4096)
    assert args.vocab_size == 151936 and args.moe.num_experts == 128 and args.moe.top_k == 8 and args.moe.route_norm
    with torch.device("meta"):
        model = Decoder(args)
    assert abs(count_params(model) - total) / total < 0.01
    with_embedding = args.active_params(count_params(model, exclude_embedding=True)) + args.vocab_size * args.dim
    assert abs(with_embedding - active) / active < 0.03


def _random_model(seed: int) -> torch.nn.Module:
    model = load_model(CONFIG, overrides=["--debug.seed", str(seed)])
    with torch.no_grad():
        for layer in model.layers.values():
            # Spread the routing so that logits depend on which experts each token picks.
            layer.moe.router.gate.weight.normal_(0, 1.0)
    return model


def test_our_export_loads_in_transformers_with_our_logits(tmp_path):
    model = _random_model(seed=torch.randint(0, 1000, ()).item())
    adapter = Qwen3MoeStateDictAdapter(model.args)
    write_hf_folder(tmp_path, model.state_dict(), adapter, build_tokenizer("assets/tokenizer"), "assets/tokenizer",
                    "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"], config["norm_topk_prob"]) == (8, 2, True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokens = torch.randint(0, model.args.vocab_size, (2, 48))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_a_transformers_saved_checkpoint_imports_with_its_logits(tmp_path):
    args = qwen3_moe_flavors["debugmodel"].finalize(2048, 64)
    config = transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=args.dim, intermediate_size=args.hidden_dim, moe_intermediate_size=32,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(torch.randint(0, 1000, ()).item())
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp_path)
    ours = load_model(CONFIG, str(tmp_path))
    tokens = torch.randint(0, 2048, (2, 48))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_fused_expert_tensors_import_like_per_expert_ones():
    model = _random_model(seed=3)
    adapter = Qwen3MoeStateDictAdapter(model.args)
    per_expert = adapter.to_hf(model.state_dict())
    fused = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    for layer in range(model.args.n_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([per_expert[f"{prefix}.{j}.gate_proj.weight"] for j in range(8)])
        up = torch.stack([per_expert[f"{prefix}.{j}.up_proj.weight"] for j in range(8)])
        fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{prefix}.down_proj"] = torch.stack([per_expert[f"{prefix}.{j}.down_proj.weight"] for j in range(8)])
    ours, again = adapter.from_hf(per_expert), adapter.from_hf(fused)
    assert ours.keys() == again.keys() == {k for k in model.state_dict()}
    assert all(torch.equal(ours[k], again[k]) for k in ours)
    assert torch.equal(ours["layers.1.moe.experts.w2"], model.layers["1"].moe.experts.w2)


def test_a_trained_routing_bias_is_refused_or_dropped_with_a_log_line(caplog):
    model = _random_model(seed=4)
    model.layers["2"].moe.expert_bias[5] = -0.012
    with pytest.raises(ValueError, match=r"layers.2.moe.expert_bias is non-zero \(largest \|bias\| 0.012\) but "
                                         r"Qwen3MoeForCausalLM has no routing bias"):
        Qwen3MoeStateDictAdapter(model.args).to_hf(model.state_dict())
    adapter = Qwen3MoeStateDictAdapter(model.args)
    adapter.drop_expert_bias = True
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        out = adapter.to_hf(model.state_dict())
    assert not any("bias" in k for k in out)
    assert "the largest was 0.012 in layers.2.moe.expert_bias" in caplog.text


def _check(flags, world_size):
    # A dense model's cases start from the dense tiny preset (the MoE preset sets [moe] options).
    config = "train_configs/tiny.toml" if "llama3" in flags else CONFIG
    cfg, sources = load_config(["--job.config_file", config, *flags])
    validate_config(cfg, sources, world_size=world_size)


@pytest.mark.parametrize("flags, world_size, message", [
    (["--parallelism.expert_parallel_degree", "3"], 6,
     "expert_parallel_degree = 3 does not divide the model's moe.num_experts = 8"),
    (["--parallelism.expert_parallel_degree", "4"], 2,
     "expert_parallel_degree = 4 does not divide data_parallel_shard_degree x context_parallel_degree = 2 x 1 = 2"),
    (["--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "3",
      "--parallelism.data_parallel_shard_degree", "2", "--training.seq_len", "384"], 6,
     "expert_parallel_degree = 2 must divide context_parallel_degree = 3 or be a multiple of it"),
    (["--moe.bias_update_rate", "-1"], 1, "moe.bias_update_rate = -1.0 is invalid; it must be >= 0"),
    (["--moe.aux_loss_type", "batch"], 1, "moe.aux_loss_type = 'batch' would do nothing: moe.aux_loss_coeff is 0"),
    (["--checkpoint.enable", "--checkpoint.last_save_in_hf"], 1,
     "checkpoint.last_save_in_hf = True would export a routing bias that moe.bias_update_rate > 0 trains"),
    (["--model.name", "llama3", "--parallelism.expert_parallel_degree", "2"], 2,
     "expert_parallel_degree = 2 needs a model with MoE layers"),
    (["--model.name", "llama3", "--moe.aux_loss_coeff", "0.01"], 1,
     "moe.aux_loss_coeff = 0.01 is set, but this model.flavor has no MoE layers"),
    (["--model.name", "llama3", "--moe.router_dtype", "compute"], 1,
     "moe.router_dtype = 'compute' is set, but this model.flavor has no MoE layers"),
])
def test_bad_moe_layouts_and_options_are_one_line_errors_naming_the_field(flags, world_size, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _check(flags, world_size)


def test_good_moe_layouts_validate():
    _check(["--parallelism.expert_parallel_degree", "2"], 2)
    _check(["--parallelism.expert_parallel_degree", "4", "--parallelism.context_parallel_degree", "2"], 4)
    _check(["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 4)
    _check(["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.hf_drop_expert_bias"], 1)
    _check(["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--moe.bias_update_rate", "0"], 1)
    _check(["--moe.aux_loss_type", "batch", "--moe.aux_loss_coeff", "0.01"], 1)


@pytest.mark.parametrize("degrees, ep, efsdp", [
    ({"data_parallel_shard_degree": 8}, 4, 2), ({"data_parallel_shard_degree": 2, "context_parallel_degree": 4}, 8, 1),
    ({"data_parallel_shard_degree": 4, "context_parallel_degree": 2}, 2, 4)])
def test_expert_parallel_is_carved_from_dp_shard_x_cp_without_changing_other_degrees(degrees, ep, efsdp):
    p = Parallelism(**degrees, expert_parallel_degree=ep)
    dims = ParallelDims.from_config(p, world_size=8)
    assert dims.expert_parallel_problem() is None
    assert (dims.dp_shard, dims.cp, dims.ep, dims.efsdp) == (degrees["data_parallel_shard_degree"],
                                                             degrees.get("context_parallel_degree", 1), ep, efsdp)
    dimensions, parts = dims._dimensions()
    sizes = dict(dimensions)
    product = 1
    for d in parts["ep"]:
        product *= sizes[d]
    assert product == ep
