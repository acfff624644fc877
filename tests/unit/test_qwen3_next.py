"""Qwen3-Next in one process: the published size, the Hugging Face mapping both ways against transformers, packed
documents kept apart, and its configuration rules."""

import dataclasses
import json

import pytest
import torch
import transformers

from torchtitan.components.checkpointing.hf_folder import write_hf_folder
from torchtitan.data import build_tokenizer
from torchtitan.inference import load_model
from torchtitan.models.qwen3_next import Qwen3NextModel, Qwen3NextStateDictAdapter, qwen3_next_flavors
from torchtitan.models.qwen3_next.model import GatedAttention
from torchtitan.models.shared.gated_deltanet import GatedDeltaNet
from torchtitan.protocols import count_params

CONFIG = "train_configs/qwen3_next_debug.toml"


def test_the_published_size_has_its_layout_and_80b_parameters():
    args = qwen3_next_flavors["80B-A3B"].finalize(tokenizer_vocab_size=2048, seq_len=4096)
    assert args.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"] and args.n_full_layers == 12
    assert (args.rotary_dim, args.rope_theta, args.moe.num_experts, args.moe.top_k) == (64, 1e7, 512, 10)
    with torch.device("meta"):
        model = Qwen3NextModel(args)
    assert abs(count_params(model) - 80e9) / 80e9 < 0.01
    assert isinstance(model.layers["0"].attention, GatedDeltaNet)
    assert isinstance(model.layers["3"].attention, GatedAttention)
    # The linear blocks' FLOPs do not grow with the sequence; the full-attention blocks' do, linearly per token.
    non_embedding = count_params(model, exclude_embedding=True)
    growth = args.flops_per_token(non_embedding, 8192) - args.flops_per_token(non_embedding, 4096)
    assert growth == 12 * 12 * args.n_heads * args.head_dim * 4096


def _random_model(seed: int) -> torch.nn.Module:
    model = load_model(CONFIG, overrides=["--debug.seed", str(seed)])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)  # zero-centred norms start at 0: move them off so a misread shows
            elif "router.gate" in name:
                param.normal_(0, 1.0)  # spread the routing so that logits depend on which experts each token picks
    return model


def test_our_export_loads_in_transformers_with_our_logits(tmp_path):
    model = _random_model(seed=torch.randint(0, 1000, ()).item())
    adapter = Qwen3NextStateDictAdapter(model.args)
    write_hf_folder(tmp_path, model.state_dict(), adapter, build_tokenizer("assets/tokenizer"), "assets/tokenizer",
                    "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    tokens = torch.randint(0, model.args.vocab_size, (2, 100))  # not a multiple of the 64-token chunk
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_a_transformers_saved_checkpoint_imports_with_its_logits(tmp_path):
    args = qwen3_next_flavors["debugmodel"]
    config = transformers.Qwen3NextConfig(
        vocab_size=2048, hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    torch.manual_seed(torch.randint(0, 1000, ()).item())
    hf = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or "mlp.gate." in name:
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    ours = load_model(CONFIG, str(tmp_path))
    tokens = torch.randint(0, 2048, (2, 80))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_a_document_does_not_see_the_one_before_it():
    model = _random_model(seed=torch.randint(0, 1000, ()).item())
    ids = torch.tensor([[0] * 40 + [1] * 60 + [2] * 28, [0] * 64 + [1] * 64])
    tokens = torch.randint(0, model.args.vocab_size, ids.shape)
    changed = tokens.clone()
    changed[0, 40:100] = torch.randint(0, model.args.vocab_size, (60,))  # the middle document of row 0
    changed[1, :64] = torch.randint(0, model.args.vocab_size, (64,))  # the first of row 1, ending on a chunk
    with torch.no_grad():
        before, after = model(tokens, document_ids=ids), model(changed, document_ids=ids)
    assert torch.equal(before[0, 100:], after[0, 100:]) and torch.equal(before[1, 64:], after[1, 64:])
    assert torch.equal(before[0, :40], after[0, :40])
    assert not torch.allclose(before[0, 40:100], after[0, 40:100])
    # Without the documents the later tokens do see the change.
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[0, 100:], model(changed)[0, 100:])


def test_tensor_parallel_degree_must_split_the_linear_heads():
    args = qwen3_next_flavors["debugmodel"]
    assert args.check_tensor_parallel(2) == []
    assert [name for name, _ in args.check_tensor_parallel(4)] == ["n_kv_heads", "linear_n_key_heads"]


@pytest.mark.parametrize("field, value", [("linear_n_value_heads", 3), ("partial_rotary_factor", 0.3),
                                          ("full_attention_interval", 0)])
def test_bad_shapes_are_refused_by_name(field, value):
    problems = dataclasses.replace(qwen3_next_flavors["debugmodel"], **{field: value}).check()
    assert [name for name, _ in problems] == [field]


def test_the_planner_sees_the_linear_blocks():
    from torchtitan import planner
    from torchtitan.config import load_config

    def shape(seq_len: int):
        cfg, _ = load_config(["--job.config_file", "train_configs/qwen3_next_80b_a3b.toml", "--training.seq_len",
                              str(seq_len), "--training.mixed_precision_param", "bfloat16"])
        return cfg, planner.model_shape(cfg, vocab_size=151936)

    cfg, m = shape(4096)
    # 12 gated-attention blocks of 16 heads x 256; 36 linear blocks of 32 value heads (128 x 128 state each) and a
    # conv over 16 key heads' q, k (128 each) and their 2 x 128 values.
    assert m.attention_flops_per_token == 12 * 12 * 16 * 256 * 4096
    assert m.linear_layers == ((32, 128, 128, 16 * (2 * 128 + 2 * 128)),) * 36
    assert m.mixer_flops_per_token == 36 * (18 * 32 * 128 * 128 + 6 * 4 * 16 * 512)
    _, longer = shape(8192)
    assert longer.mixer_flops_per_token == m.mixer_flops_per_token  # the linear blocks' do not grow with the length
    assert longer.attention_flops_per_token == 2 * m.attention_flops_per_token
    # Activations are counted per kind of block: the linear ones' own, not an attention block's.
    hybrid = planner.layer_activation_bytes(m, cfg, on_cpu=False, tp=1)
    assert hybrid != planner.layer_activation_bytes(dataclasses.replace(m, linear_layers=()), cfg, on_cpu=False,
                                                    tp=1)


def test_released_multi_token_prediction_tensors_are_skipped_on_import():
    model = _random_model(seed=1)
    adapter = Qwen3NextStateDictAdapter(model.args)
    hf = adapter.to_hf(model.state_dict())
    ours = adapter.from_hf({**hf, "mtp.fc.weight": torch.zeros(4, 4), "mtp.layers.0.input_layernorm.weight":
                            torch.zeros(4)})
    assert set(ours) == set(adapter.from_hf(hf)) and not any(name.startswith("mtp") for name in ours)


def test_muon_leaves_conv_filters_and_the_shared_gate_to_adamw():
    from torchtitan.components.optimizers.muon import split_parameters

    muon, adamw = split_parameters([_random_model(seed=2)])
    muon_names, adamw_names = {n for n, _ in muon}, {n for n, _ in adamw}
    assert "layers.0.attention.conv.weight" in adamw_names and "layers.0.moe.shared_gate.weight" in adamw_names
    assert "layers.0.attention.in_proj_qkv.weight" in muon_names


def test_a_sequence_too_short_for_the_conv_under_context_parallelism_is_refused_by_name():
    from torchtitan.config import ConfigError, load_config
    from torchtitan.config_check import validate_config

    cfg, sources = load_config(["--job.config_file", "train_configs/qwen3_next_debug.toml", "--training.seq_len", "8",
                                "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError, match=r"training.seq_len = 8 splits into chunks of 2 tokens.*seq_len >= 12"):
        validate_config(cfg, sources, world_size=2)
